"""A client leaves while its request is queued or in a long prefill, or stops reading mid-stream.

Each test reads the state of the request's engine `Request` when the client
leaves (waiting; part-way through its prefill; decoding behind full socket
buffers) to prove the case it claims, then what the request cost afterwards.
"""

import pytest

from pagoda.api.stream_writer import KEEPALIVE, MEDIA_TYPES
from pagoda.core.request import FinishReason, RequestStatus
from tests.disconnect.helpers import (
    ENDPOINTS,
    EVERY_PATH,
    PATHS,
    RawClient,
    access_log,  # noqa: F401  (fixtures)
    metric_values,
    new_request,
    one_slot_server,  # noqa: F401
    request_body,
    start_live,
    wait_for,
)


PATH_IDS = [f"{protocol}-{'stream' if stream else 'unary'}" for protocol, stream in EVERY_PATH]


@pytest.mark.parametrize(("protocol", "stream"), EVERY_PATH, ids=PATH_IDS)
def test_a_client_that_leaves_while_queued_never_costs_a_step(one_slot_server, access_log, protocol,  # noqa: F811
                                                               stream):
    live = one_slot_server
    before = live.assert_pool_whole()
    blocker_client = RawClient(live.url).post(PATHS["completions"], request_body("completions", max_tokens=600,
                                                                                 stream=True))
    blocker = new_request(live)
    wait_for(lambda: blocker.num_output_tokens >= 1, "the blocker to be decoding")
    queued_client = RawClient(live.url).post(PATHS[protocol], request_body(protocol, max_tokens=50, stream=stream))
    queued = new_request(live, known={blocker.request_id})
    assert queued.status is RequestStatus.WAITING and blocker.status is RequestStatus.RUNNING  # behind the blocker
    queued_client.close()

    wait_for(lambda: queued.is_finished, "the queued request to be aborted")
    assert queued.finish_reason is FinishReason.ABORT
    assert queued.num_computed_tokens == 0 and queued.num_output_tokens == 0  # not one token of work
    assert not blocker.is_finished  # the request it waited behind carries on
    blocker_client.close()
    after = live.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"] + 2
    wait_for(lambda: any(r.status == 499 and r.path == PATHS[protocol] for r in access_log()), "the 499 line")


@pytest.mark.parametrize(("protocol", "stream"), EVERY_PATH, ids=PATH_IDS)
def test_a_client_that_leaves_during_a_long_prefill_gets_no_decode(one_slot_server, access_log, protocol,  # noqa: F811
                                                                   stream):
    live = one_slot_server
    before = live.assert_pool_whole()
    # ~900 prompt tokens at 8 a step: the prefill takes ~110 steps.
    body = request_body(protocol, max_tokens=8, stream=stream, prompt="stone " * 880)
    client = RawClient(live.url).post(PATHS[protocol], body)
    request = new_request(live)
    prompt = request.num_prompt_tokens
    assert prompt > 800
    if stream:  # the status line (and, for SSE, a comment) went out at admission, before the prefill ends
        stream_format = ENDPOINTS[protocol].stream_format
        head = client.read_until(KEEPALIVE if stream_format == "sse" else b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and MEDIA_TYPES[stream_format].split(";")[0].encode() in head
    wait_for(lambda: request.num_computed_tokens >= 8, "the prefill to have started")
    at_close = request.num_computed_tokens
    client.close()

    wait_for(lambda: request.is_finished, "the request to be aborted")
    assert 0 < at_close < prompt and request.finish_reason is FinishReason.ABORT
    assert request.num_computed_tokens < prompt  # the prefill never finished
    assert request.num_output_tokens == 0  # abandoned before any decode
    after = live.assert_pool_whole()
    assert after["generated_tokens_total"] == before["generated_tokens_total"]
    assert after["aborted_total"] == before["aborted_total"] + 1
    wait_for(lambda: any(r.status == 499 and r.path == PATHS[protocol] for r in access_log()), "the 499 line")


# -- a client that stops reading ----------------------------------------------------------------------
STALL_TIMEOUT = 0.5
SEND_BUFFER = 16384  # the server's SO_SNDBUF: the buffers fill after ~100 KB, not megabytes


@pytest.fixture(scope="module")
def stall_server(tiny_model_dir):
    settings = {"send_stall_timeout": STALL_TIMEOUT, "send_buffer_size": SEND_BUFFER}
    live = start_live(tiny_model_dir, "stall", settings=settings, num_blocks=64, block_size=16, max_running=4,
                      max_batched_tokens=256, max_model_len=1024)
    yield live
    live.server.stop()


def test_a_client_that_stops_reading_is_cut_off_after_the_stall_deadline(stall_server, access_log):  # noqa: F811
    live = stall_server
    before = live.assert_pool_whole()
    # ~1.5 KB of logprobs per token, to a receive buffer of 4 KB that is never read.
    body = request_body("chat", max_tokens=900, stream=True, logprobs=True, top_logprobs=20)
    client = RawClient(live.url, rcvbuf=4096).post(PATHS["chat"], body)
    request = new_request(live)

    wait_for(lambda: request.is_finished, "the stalled request to be aborted", timeout=120)
    assert request.finish_reason is FinishReason.ABORT
    assert 0 < request.num_output_tokens < 900  # cut off mid-generation, not finished
    wait_for(lambda: any(r.status == 499 for r in access_log()), "the 499 line")
    line = next(r for r in access_log() if r.status == 499)
    assert line.reason == "send_stall" and line.path == PATHS["chat"]
    assert metric_values(live.url)["pagoda_requests_aborted_total{reason=send_stall}"] == 1
    after = live.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"] + 1

    # The server closed the connection: what it had buffered arrives, then EOF (no [DONE]).
    received = client.read_to_eof(timeout=60)
    client.close()
    assert len(received) > 65536  # the buffers really were full: a stall, not a disconnect
    assert b"HTTP/1.1 200 " in received and b"[DONE]" not in received
