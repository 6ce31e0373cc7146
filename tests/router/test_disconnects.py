"""The disconnect matrix through the router: a client that hangs up at the router ends its job on the replica.

Every path (each registered endpoint, stream and not) over real sockets, as tests/disconnect/test_paths.py
runs it against one server: the client leaves once the replica's engine has generated tokens for its
request (mid-decode), and the replica must abort it (finish reason
abort, far fewer tokens than asked, its `aborted_total` one up), every block back in both pools, and
nothing left in flight at the router. A client that leaves during a long prefill (a unary one has had no
byte back yet: the router is still waiting for the replica's answer) gets no decode at all.
"""

from __future__ import annotations

import httpx
import pytest

from pagoda.core.request import FinishReason, Request
from pagoda.harness.live_server import LiveServer
from tests.disconnect.helpers import EVERY_PATH, ONE_SLOT_ENGINE, PATHS, RawClient, request_body, start_live
from tests.helpers import metric_values, wait_for
from tests.router.helpers import live_router, replicas  # noqa: F401  (fixtures)

ASKED = 800
HANGUP_AT = 20  # tokens generated for the request when its client leaves
FAR_FEWER = ASKED // 5
PATH_IDS = [f"{protocol}-{'stream' if stream else 'unary'}" for protocol, stream in EVERY_PATH]


@pytest.fixture(scope="module")
def router(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], policy="round_robin") as live:
        yield live


def new_request(replicas: list[LiveServer]) -> tuple[LiveServer, Request]:
    """The replica that admitted the one new request, and the engine's live Request object of it."""
    found: list[tuple[LiveServer, Request]] = []

    def admitted() -> bool:
        found[:] = [(live, r) for live in replicas for r in dict(live.async_engine.engine.requests).values()]
        return bool(found)

    wait_for(admitted, "the request to reach a replica's engine")
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(("protocol", "stream"), EVERY_PATH, ids=PATH_IDS)
def test_a_client_that_hangs_up_at_the_router_mid_decode_ends_its_job(router, replicas, protocol, stream):  # noqa: F811
    before = [live.assert_pool_whole() for live in replicas]
    left_before = metric_values(router.url)["pagoda_router_client_disconnects_total"]
    client = RawClient(router.url).post(PATHS[protocol], request_body(protocol, max_tokens=ASKED, stream=stream))
    live, request = new_request(replicas)
    wait_for(lambda: request.num_output_tokens >= HANGUP_AT, "the request to be decoding")
    client.close()

    wait_for(lambda: request.finish_reason is FinishReason.ABORT, "the replica to abort the request", timeout=30)
    assert request.num_output_tokens < FAR_FEWER, request.num_output_tokens
    after = [r.assert_pool_whole() for r in replicas]  # idle (asked of each loop), audited, every block back
    index = replicas.index(live)
    assert after[index]["aborted_total"] == before[index]["aborted_total"] + 1
    assert after[1 - index]["aborted_total"] == before[1 - index]["aborted_total"]
    assert httpx.get(f"{live.url}/health").json()["aborted_total"] == after[index]["aborted_total"]
    wait_for(lambda: router.in_flight() == [0, 0], "the router to let the request go")
    assert metric_values(router.url)["pagoda_router_client_disconnects_total"] == left_before + 1


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):  # noqa: F811
    """One replica with one running slot and 8 new tokens a step (a long prompt's prefill spans ~110 steps)."""
    live = start_live(tiny_model_dir, "one-slot", **ONE_SLOT_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_hangs_up_during_a_long_prefill_ends_its_job_before_any_decode(one_slot, stream):
    """Unary: nothing has come back through the router yet, it is waiting for the replica's first byte."""
    before = one_slot.assert_pool_whole()
    with live_router([one_slot.url]) as router:
        body = request_body("chat", max_tokens=8, stream=stream, prompt="stone " * 880)
        client = RawClient(router.url).post(PATHS["chat"], body)
        _, request = new_request([one_slot])
        assert request.num_prompt_tokens > 800
        wait_for(lambda: request.num_computed_tokens >= 8, "the prefill to have started")
        client.close()
        wait_for(lambda: request.is_finished, "the replica to abort the request", timeout=30)
        assert request.finish_reason is FinishReason.ABORT
        assert request.num_computed_tokens < request.num_prompt_tokens and request.num_output_tokens == 0
        after = one_slot.assert_pool_whole()
        assert after["aborted_total"] == before["aborted_total"] + 1
        assert after["generated_tokens_total"] == before["generated_tokens_total"]
        wait_for(lambda: router.in_flight() == [0], "the router to let the request go")
