"""Every path (each registered endpoint, stream and not) over real sockets: hang-ups end the work, nothing else does.

Each hang-up test proves it was hard: the client leaves only once the engine
has generated tokens for it (it was mid-decode), and with one running slot
the next request can only start after the departed one was removed, so "the
next request was not kept waiting" is read off the engine's counters.
"""

from importlib import metadata

import httpx
import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.manager import ENTRY_POINT_GROUP
from tests.disconnect.helpers import (
    ENDPOINTS,
    EVERY_PATH,
    PATHS,
    PROTOCOLS,
    RawClient,
    access_log,  # noqa: F401  (fixtures)
    metric_values,
    new_request,
    one_slot_server,  # noqa: F401
    request_body,
    start_live,
    wait_for,
)

ASKED = 800
HANGUP_AT = 20  # tokens generated for the request when its client leaves (~0.15 s in on the tiny model)
FAR_FEWER = ASKED // 5  # what "far fewer than asked" means here, with room for a loaded machine
PATH_IDS = [f"{protocol}-{'stream' if stream else 'unary'}" for protocol, stream in EVERY_PATH]


@pytest.mark.parametrize(("protocol", "stream"), EVERY_PATH, ids=PATH_IDS)
def test_a_client_that_hangs_up_mid_decode_ends_its_work(one_slot_server, access_log, protocol, stream):  # noqa: F811
    live = one_slot_server
    before = live.assert_pool_whole()
    aborted_before = metric_values(live.url).get("pagoda_requests_aborted_total{reason=client_disconnect}", 0)
    client = RawClient(live.url).post(PATHS[protocol], request_body(protocol, max_tokens=ASKED, stream=stream))
    request = new_request(live)
    wait_for(lambda: request.num_output_tokens >= HANGUP_AT, "the request to be decoding")
    at_close = request.num_output_tokens
    client.close()

    # Sent right after the hang-up; with one slot it runs only once the first request is gone.
    second = RawClient(live.url).post(PATHS["completions"], request_body("completions", max_tokens=4, stream=True))
    second.read_until(b'data: {"id"')  # its first token
    assert request.finish_reason is FinishReason.ABORT  # removed before the second could start
    spent = request.num_output_tokens
    assert HANGUP_AT <= at_close <= spent < FAR_FEWER, (at_close, spent)
    second.read_until(b"data: [DONE]")
    second.close()

    after = live.assert_pool_whole()  # idle (asked of the loop), audited, every block back
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == spent + 4
    path = PATHS[protocol]
    wait_for(lambda: any(r.status == 499 and r.path == path for r in access_log()), "the 499 line")
    line = next(r for r in access_log() if r.status == 499 and r.path == path)
    assert line.reason == "client_disconnect" and 0 < line.completion_tokens <= spent  # what reached the server
    aborted_after = metric_values(live.url)["pagoda_requests_aborted_total{reason=client_disconnect}"]
    assert aborted_after == aborted_before + 1


@pytest.mark.parametrize("first_streams", [False, True], ids=["unary-first", "stream-first"])
def test_a_pipelined_follow_up_request_is_not_a_disconnect(one_slot_server, access_log, first_streams):  # noqa: F811
    live = one_slot_server
    before = live.assert_pool_whole()
    client = RawClient(live.url)
    first = client.request_bytes(PATHS["messages"], request_body("messages", max_tokens=40, stream=first_streams))
    follow_up = client.request_bytes(PATHS["chat"], request_body("chat", max_tokens=5, stream=False))
    client.sock.sendall(first + follow_up)  # the follow-up is on the wire while the first is generating

    status, body = client.read_response()
    assert status == 200
    if first_streams:
        assert b'"output_tokens":40' in body and body.rstrip().endswith(b'"message_stop"}')  # message_delta's usage
    else:
        assert httpx.Response(200, content=body).json()["usage"]["output_tokens"] == 40
    status, body = client.read_response()
    assert status == 200 and httpx.Response(200, content=body).json()["usage"]["completion_tokens"] == 5
    client.close()

    after = live.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"]
    assert after["requests_total"] == before["requests_total"] + 2
    assert after["generated_tokens_total"] == before["generated_tokens_total"] + 45
    wait_for(lambda: sum(r.path in (PATHS["messages"], PATHS["chat"]) for r in access_log()) == 2, "both log lines")
    assert all(r.status == 200 for r in access_log())


# -- refusals stay refusals ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pool_server(tiny_model_dir):
    """A pool (16 blocks of 16 = 256 tokens) much smaller than the context (1024)."""
    live = start_live(tiny_model_dir, "small-pool", num_blocks=16, block_size=16, max_running=4,
                      max_batched_tokens=256, max_model_len=1024)
    yield live
    live.server.stop()


@pytest.mark.parametrize(("protocol", "stream"), EVERY_PATH, ids=PATH_IDS)
def test_refused_requests_are_still_a_400_on_every_path(small_pool_server, protocol, stream):
    live = small_pool_server
    before = live.assert_pool_whole()
    shape = ENDPOINTS[protocol].errors
    too_many_blocks = request_body(protocol, max_tokens=500, stream=stream)  # fits the context, not the pool
    too_long = request_body(protocol, max_tokens=8, stream=stream, prompt="pagoda " * 1100)  # beyond the context
    for body, words in ((too_many_blocks, "KV blocks"), (too_long, "context")):
        r = httpx.post(f"{live.url}{PATHS[protocol]}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = shape.read_error(400, r.json())
        assert words in error.message
        assert r.json() == shape.render_error(error)  # the endpoint's own shape of a 400
        if isinstance(r.json()["error"], dict):  # a shape with error types (OpenAI's, Anthropic's)
            assert r.json()["error"]["type"] == "invalid_request_error"
        if protocol == "messages":
            assert r.json()["type"] == "error"
    after = live.assert_pool_whole()
    assert after["requests_total"] == before["requests_total"] and after["aborted_total"] == before["aborted_total"]


def test_every_protocol_is_covered():
    assert {"completions", "chat", "responses", "messages"} <= set(PROTOCOLS)
    assert len(EVERY_PATH) == 2 * len(PROTOCOLS) >= 8
    installed = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if "ollama" in installed:  # a third-party plugin's endpoints join the matrix like the built-in ones
        assert {"ollama-generate", "ollama-chat"} <= set(PROTOCOLS)
