"""The workloads of `pagoda bench serve`, the request body and the summary numbers (no server)."""

from __future__ import annotations

import pytest

from pagoda.bench.serve.client import RequestRecord, ask_for, pagoda_endpoints, peer_endpoints
from pagoda.bench.serve.load import LevelRun
from pagoda.bench.serve.report import latency_ms, meets_slo, summarize
from pagoda.bench.serve.workloads import TOPICS, conversations, from_crowd, paragraphs, prompts_for, synthetic
from pagoda.simulator.crowd import crowd_to_json, mixed_crowd


def test_synthetic_prompts_are_seeded_and_sized():
    a, b = synthetic(3, 12, 5, seed=1), synthetic(3, 12, 5, seed=1)
    assert a == b and a != synthetic(3, 12, 5, seed=2)
    assert all(len(p.text.split()) == 12 and p.max_tokens == 5 for p in a)


def test_paragraphs_are_the_sixteen_topics():
    ps = paragraphs(64)
    assert len(ps) == len(TOPICS) == 16
    assert ps[0].text == "Write a detailed paragraph about the ocean." and {p.max_tokens for p in ps} == {64}


def test_a_crowd_file_gives_its_prompts_and_lengths(tmp_path):
    plans = mixed_crowd(seed=3, clients=5)
    path = tmp_path / "crowd.json"
    path.write_text(crowd_to_json(plans))
    prompts = from_crowd(path)
    assert [p.max_tokens for p in prompts] == [plan.max_tokens for plan in plans]
    assert [len(p.text.split()) for p in prompts] == [plan.prompt_len for plan in plans]
    assert prompts_for("crowd", num_requests=1, input_len=1, output_len=1, seed=0, crowd=str(path)) == prompts
    with pytest.raises(ValueError, match="--crowd"):
        prompts_for("crowd", num_requests=1, input_len=1, output_len=1, seed=0, crowd=None)


def test_conversations_share_one_system_prompt():
    convs = conversations(3, 4, system_tokens=50, user_tokens=6, seed=0)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system.split()) == 50 + 5
    assert all(len(c.user_turns) == 4 for c in convs)
    assert len({u for c in convs for u in c.user_turns}) == 12  # every user message differs


def test_the_body_fixes_the_output_length_for_every_server_kind():
    ours, peer = pagoda_endpoints(), peer_endpoints()
    body = peer["completions"].client_request(ask_for("m", "hi", 7, 0.0))  # a peer: the same, and llama.cpp's field
    assert (body["max_tokens"], body["n_predict"], body["ignore_eos"], body["stream"]) == (7, 7, True, True)
    assert body["prompt"] == "hi" and body["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in body.items() if k != "n_predict"} == ours["completions"].client_request(
        ask_for("m", "hi", 7, 0.0))
    chat = peer["chat"].client_request(ask_for("m", "u", 3, 0.5, system="s", history=(("u0", "a0"),)))
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user"] and "prompt" not in chat


def record(ttft: float, gaps: list[float], tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord("pagoda", 1, 0, 0.0, ok=ok, ttft=ttft, itl=gaps, e2e=ttft + sum(gaps), output_tokens=tokens)


def test_percentiles_tpot_and_goodput():
    lat = latency_ms([0.001 * i for i in range(1, 101)])
    assert lat["p50"] == pytest.approx(50.5) and lat["p99"] == pytest.approx(99.01) and lat["n"] == 100
    assert latency_ms([]) is None
    fast, slow = record(0.1, [0.01, 0.01], 3), record(2.0, [0.2, 0.2], 3)
    assert fast.tpot == pytest.approx(0.01)
    assert meets_slo(fast, 500, 50) and not meets_slo(slow, 500, None) and not meets_slo(slow, None, 50)
    assert not meets_slo(record(0.1, [], 1, ok=False), None, None)
    run = LevelRun([fast, slow, record(0.1, [], 0, ok=False)], duration=2.0)
    s = summarize("pagoda", "concurrency", 1, run, None, slo_ttft_ms=500)
    assert (s["ok"], s["failed"], s["req_per_s"], s["out_tok_per_s"], s["goodput_req_per_s"]) == (2, 1, 1.0, 3.0, 0.5)
    assert s["itl_ms"]["n"] == 4 and s["server_split_ms"] is None


def test_a_request_the_peer_drops_unanswered_is_sent_once_more_and_no_more():
    """A server that closes the connection, unanswered, on the first `drops` requests (as llama-server sometimes
    does with a kept-alive connection): one retry, then the error is the record's."""
    import asyncio

    import httpx

    from pagoda.bench.serve.client import Target, peer_endpoints, stream_request

    chunk = ('{"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}],'
             ' "usage": {"prompt_tokens": 3, "completion_tokens": 1}}')
    body = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()

    async def run(drops: int) -> RequestRecord:
        seen = [0]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            seen[0] += 1
            if seen[0] > drops:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            target = Target("peer", f"http://127.0.0.1:{port}", endpoints=peer_endpoints())
            record = RequestRecord("peer", 1, 0, 0.0)
            async with httpx.AsyncClient(trust_env=False) as http:
                await stream_request(http, target, "chat", ask_for("m", "hi", 1, 0.0), record, timeout=30)
            record.conversation = seen[0]  # how many requests the server saw
            return record
        finally:
            server.close()
            await server.wait_closed()

    once = asyncio.run(run(drops=1))
    assert once.ok and once.output_tokens == 1 and once.conversation == 2
    twice = asyncio.run(run(drops=2))
    assert not twice.ok and "RemoteProtocolError" in twice.error and twice.conversation == 2
