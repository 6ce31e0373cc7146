"""Health and failure: /health sums and lists the replicas; a replica down, draining or killed is routed around,
and the requests it had end cleanly (bounded waits, never a fixed sleep)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import httpx
import pytest

from pagoda.plugins.client import ClientError, line_data
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.router.replicas import SUMMED_FIELDS
from tests.disconnect.helpers import ENDPOINTS, PATHS, RawClient, request_body
from tests.helpers import metric_values, wait_for
from tests.router.helpers import REPLICA_HEADER, live_router, replicas, served_by, start_replica  # noqa: F401
from tests.router.test_proxy import FIRST_TOKEN, open_stream
from tests.server_fixtures import TINY_NAME

ROUTER_FIELDS = {"url", "status", "in_flight", "max_in_flight", "error"}


def closed_port_url() -> str:
    """A URL where nothing listens (a port the kernel gave us, closed again): connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def unary(url: str, protocol: str = "completions", max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{url}{PATHS[protocol]}", json=request_body(protocol, max_tokens=max_tokens, stream=False),
                      timeout=60)


def test_health_sums_the_healthy_replicas_counters_and_lists_each_one(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], max_queue_per_replica=7) as router:
        assert unary(router.url).status_code == 200 and unary(router.url).status_code == 200

        def agrees() -> bool:  # once a poll has seen the idle replicas' latest stats
            own = [httpx.get(f"{r.url}/health").json() for r in replicas]
            health = router.health().json()
            entries = [{k: v for k, v in entry.items() if k not in ROUTER_FIELDS} for entry in health["replicas"]]
            return entries == [{k: v for k, v in h.items() if k != "status"} for h in own]

        wait_for(agrees, "the router's /health to catch up with the replicas'")
        r = router.health()
        health, own = r.json(), [httpx.get(f"{live.url}/health").json() for live in replicas]
        assert r.status_code == 200 and health["status"] == "ok" and health["replicas_healthy"] == 2
        summed = [k for k, v in own[0].items() if (k in SUMMED_FIELDS or k.endswith("_total")) and type(v) is int]
        assert {"running", "waiting", "kv_blocks_total", "kv_blocks_free", "aborted_total", "requests_total",
                "generated_tokens_total", "preemptions_total", "recomputed_tokens_total"} <= set(summed)
        for name in summed:
            assert health[name] == own[0][name] + own[1][name], name
        assert health["kv_blocks_total"] == 2 * 64
        assert health["policy"] == "prefix"  # the default
        assert [(e["url"], e["status"], e["in_flight"], e["max_in_flight"]) for e in health["replicas"]] == [
            (live.url, "ok", 0, 7) for live in replicas]


def test_with_no_healthy_replica_health_is_503_and_requests_get_503_in_their_shape():
    with live_router([closed_port_url()]) as router:
        r = router.health()
        assert r.status_code == 503 and r.json()["status"] == "unavailable" and r.json()["replicas_healthy"] == 0
        entry = r.json()["replicas"][0]
        assert entry["status"] == "unreachable" and "ConnectError" in entry["error"]
        r = unary(router.url, "chat")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "no_healthy_replica" and r.json()["error"]["type"] == "server_error"
        r = unary(router.url, "messages")
        assert r.status_code == 503 and r.json()["type"] == "error"
        shape = ENDPOINTS["messages"].errors
        assert r.json() == shape.render_error(shape.read_error(503, r.json()))
        assert metric_values(router.url)["pagoda_router_unavailable_total"] == 2


def test_a_stopped_replica_is_routed_around_at_once_and_polled_as_unreachable(replicas, tiny_model_dir):  # noqa: F811
    spare = start_replica(tiny_model_dir)
    try:
        # Polls an hour apart: only the requests themselves can find out that the spare is gone.
        with live_router([spare.url, replicas[0].url], policy="round_robin", health_interval=3600) as router:
            router.wait_healthy(0, 1)
            spare.server.stop()
            served = [unary(router.url) for _ in range(4)]
            assert [r.status_code for r in served] == [200] * 4
            assert [r.headers[REPLICA_HEADER] for r in served] == [replicas[0].url] * 4  # the first one retried
            key = f"pagoda_router_upstream_errors_total{{kind=connect,replica={spare.url}}}"
            assert metric_values(router.url)[key] == 1
            assert router.health().json()["replicas"][0]["status"] == "unreachable"
        with live_router([spare.url, replicas[0].url], policy="round_robin", health_interval=0.05) as router:
            router.wait_healthy(1)
            assert router.health().json()["replicas_healthy"] == 1
    finally:
        spare.server.stop()


def test_a_draining_replica_is_routed_around(replicas, tiny_model_dir):  # noqa: F811
    spare = start_replica(tiny_model_dir)
    try:
        with live_router([spare.url, replicas[0].url], policy="round_robin", health_interval=3600) as router:
            router.wait_healthy(0, 1)
            spare.server.app.state.services.drain.begin()  # what SIGTERM starts: new work refused with 503
            r = unary(router.url, "messages")  # its turn is the spare's, which refuses it: it goes to the other
            assert r.status_code == 200 and served_by(r, replicas) == 0
            key = f"pagoda_router_upstream_errors_total{{kind=unavailable,replica={spare.url}}}"
            assert metric_values(router.url)[key] == 1
        with live_router([spare.url, replicas[0].url], health_interval=0.05) as router:
            router.wait_healthy(1)
            entry = router.health().json()["replicas"][0]
            assert entry["status"] == "draining" and entry["url"] == spare.url
    finally:
        spare.server.stop()


# -- a replica killed mid-crowd ---------------------------------------------------------------------------
def serve_in_a_process(model_dir) -> tuple[subprocess.Popen, str]:
    """`python -m pagoda serve` on the tiny model, port 0: the process and its URL."""
    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(model_dir), "--port", "0", "--num-blocks", "64",
           "--max-model-len", "1024", "--device", "cpu", "--log-level", "warning",
           "--served-model-name", TINY_NAME, "m"]  # "m": the name the matrix's bodies ask for
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not (line and line[0].startswith("pagoda serving")):
        proc.kill()
        pytest.fail("the replica did not start")
    return proc, line[0].split(" at ")[1].strip()


def stream_events(protocol: str, body: bytes) -> list:
    """A stream body read by the protocol's client half, event by event; ClientError where it reports one."""
    answer = ENDPOINTS[protocol].client_answer()
    for line in body.decode().splitlines():
        data = line_data(ENDPOINTS[protocol].stream_format, line)
        if data is not None:
            answer.event(data)
    return answer


@pytest.mark.slow  # a replica in its own process (~4 s to start), then ~3 s of generation
def test_a_replica_killed_mid_crowd_ends_its_requests_cleanly_and_the_rest_go_on(replicas,  # noqa: F811
                                                                                 tiny_model_dir):  # noqa: F811
    proc, doomed = serve_in_a_process(tiny_model_dir)
    try:
        with live_router([replicas[0].url, doomed], policy="round_robin") as router:
            router.wait_healthy(0, 1)
            # In turn: a stream and a unary request on each replica, all decoding when the second one dies.
            streams = [open_stream(router.url, "completions", 400), open_stream(router.url, "messages", 400)]
            unaries = []
            for n, protocol in enumerate(("chat", "responses"), start=3):
                body = request_body(protocol, max_tokens=400, stream=False)
                unaries.append(RawClient(router.url).post(PATHS[protocol], body))
                wait_for(lambda: sum(router.in_flight()) == n, "the router to place the request")
            assert router.in_flight() == [2, 2]
            wait_for(lambda: httpx.get(f"{doomed}/health").json()["running"] == 2, "both to run on the doomed one")
            proc.kill()

            status, body = streams[1].read_response(timeout=30)  # it had begun: the protocol's error event, then end
            assert status == 200 and FIRST_TOKEN["messages"] in body
            assert body.rstrip().endswith(b"}") and b"event: error" in body
            with pytest.raises(ClientError, match="failed mid-stream"):
                stream_events("messages", body)
            status, body = unaries[1].read_response(timeout=30)  # a unary one: 502 in its protocol's shape
            error = OPENAI_ERRORS.read_error(status, httpx.Response(status, content=body).json())
            assert status == 502 and "failed" in error.message and doomed in error.message

            # the survivor's requests run to their end; new ones all go to it
            status, body = streams[0].read_response(timeout=60)
            assert status == 200 and stream_events("completions", body).finish_reason == "length"
            status, body = unaries[0].read_response(timeout=60)
            assert status == 200 and httpx.Response(200, content=body).json()["usage"]["completion_tokens"] == 400
            assert [served_by(unary(router.url), replicas) for _ in range(3)] == [0, 0, 0]
            for client in (*streams, *unaries):
                client.close()
            wait_for(lambda: router.health().json()["replicas"][1]["status"] == "unreachable", "a poll to see it")
            assert router.in_flight() == [0, 0]
            key = f"pagoda_router_upstream_errors_total{{kind=broken,replica={doomed}}}"
            assert metric_values(router.url)[key] == 2
        replicas[0].assert_pool_whole()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
