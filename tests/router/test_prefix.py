"""The prefix policy live: the router renders each prompt as a replica does, keys on the prefix cache's own
block hashes, and so sends a conversation's turns where its blocks are cached.

The proof that the router's keys are the engine's keys: every block hash the router's index holds for a
replica is a hash that replica's block manager has cached, for chat and Anthropic requests, under an API key
(the tenant seeds the chain) and a `cache_salt`. If the router rendered, tokenized or keyed differently from
the replica, none would be.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading

import httpx

from pagoda.router.prompts import PromptReader
from tests.router.helpers import live_router, served_by, start_replica

SYSTEM = ("You are the archivist of a mountain pagoda. Answer in one short sentence, plainly, and never "
          "repeat the question. ") * 3


def conversation(k: int, turns: int) -> list[list[dict[str, str]]]:
    """The message lists of one client's turns: its own system prompt, each turn the previous plus one more."""
    messages = [{"role": "system", "content": f"Client {k}. {SYSTEM}"}]
    asked = []
    for t in range(turns):
        messages = [*messages, {"role": "user", "content": f"Question {t} of client {k}: what is tier {t}?"}]
        asked.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Tier {t} holds scrolls."}]
    return asked


def test_a_conversation_stays_on_the_replica_that_caches_it_and_the_keys_are_the_engines(tiny_model_dir):  # noqa: F811
    replicas = [start_replica(tiny_model_dir, num_blocks=256) for _ in range(2)]
    try:
        with live_router([r.url for r in replicas], policy="prefix", api_key=None) as router:
            chosen: dict[int, set[int]] = {}
            for turn in range(3):  # clients interleaved, as a crowd's turns arrive
                for k in range(4):
                    body = {"model": "m", "max_tokens": 3, "temperature": 0, "messages": conversation(k, 3)[turn]}
                    if k == 3:
                        body["cache_salt"] = "tenant-secret"
                    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
                    assert r.status_code == 200, r.text
                    chosen.setdefault(k, set()).add(served_by(r, replicas))
                    if turn > 0:  # the system prompt and earlier turns were cached where it went
                        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
            assert all(len(where) == 1 for where in chosen.values()), chosen  # every turn where the first went
            assert {next(iter(w)) for w in chosen.values()} == {0, 1}  # new conversations spread over both
            policy = router.fleet.policy
            assert policy.reasons["match"] == 8 and policy.reasons["no_match"] == 4
            for i, replica in enumerate(replicas):
                held = set(policy._inner._index[i])
                cached = set(replica.async_engine.engine.block_manager.cached_blocks)
                assert held and held <= cached, f"replica {i}: {len(held - cached)} of {len(held)} hashes unknown"
            metrics = httpx.get(f"{router.url}/metrics").text
            assert 'pagoda_router_prefix_decisions_total{reason="match"} 8.0' in metrics
    finally:
        for replica in replicas:
            replica.server.stop()


def test_the_tenant_key_separates_prompts_in_the_index_as_in_the_cache(tiny_model_dir):  # noqa: F811
    replicas = [start_replica(tiny_model_dir, num_blocks=256, api_key="sekret") for _ in range(2)]
    try:
        with live_router([r.url for r in replicas], policy="prefix", api_key="sekret") as router:
            messages = conversation(0, 2)
            for asked in messages:  # Anthropic's protocol, the key in x-api-key
                r = httpx.post(f"{router.url}/v1/messages", timeout=60,
                               headers={"x-api-key": "sekret", "anthropic-version": "2023-06-01"},
                               json={"model": "m", "max_tokens": 2, "system": asked[0]["content"],
                                     "messages": asked[1:]})
                assert r.status_code == 200, r.text
            assert router.fleet.policy.reasons == {"no_match": 1, "match": 1}
            where = served_by(r, replicas)
            held = set(router.fleet.policy._inner._index[where])
            assert held and held <= set(replicas[where].async_engine.engine.block_manager.cached_blocks)
    finally:
        for replica in replicas:
            replica.server.stop()


def test_keys_file_tenants_are_checked_and_keyed_in_the_router_as_in_the_replicas_caches(tiny_model_dir, tmp_path):  # noqa: F811
    """Router and replicas read one keys file. A key it does not hold is refused by the router itself; a tenant's
    prompts are keyed by its cache key as the replica keys them (every hash the router holds is one the replica
    cached), so another tenant's identical prompt is no match."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": n, "key_sha256": hashlib.sha256(f"key-{n}".encode()).hexdigest()}
                                            for n in ("team-a", "team-b")]}))
    replicas = [start_replica(tiny_model_dir, settings={"api_keys_file": str(keys)}, num_blocks=256) for _ in range(2)]
    try:
        with live_router([r.url for r in replicas], policy="prefix", api_keys_file=str(keys)) as router:
            def ask(key, messages):
                return httpx.post(f"{router.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "m", "max_tokens": 2, "messages": messages}, timeout=60)

            refused = ask("key-nobody", conversation(0, 1)[0])
            assert refused.status_code == 401 and "x-pagoda-replica" not in refused.headers
            assert "API key" in refused.json()["error"]["message"]
            for asked in conversation(0, 2):
                r = ask("key-team-a", asked)
                assert r.status_code == 200, r.text
            where = served_by(r, replicas)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            held = set(router.fleet.policy._inner._index[where])
            assert held and held <= set(replicas[where].async_engine.engine.block_manager.cached_blocks)
            assert ask("key-team-b", conversation(0, 1)[0]).status_code == 200
            assert router.fleet.policy.reasons == {"no_match": 2, "match": 1}  # team-b's same prompt: no match
    finally:
        for replica in replicas:
            replica.server.stop()


def test_a_prompt_is_read_off_the_event_loop_so_the_router_keeps_answering(tiny_model_dir, monkeypatch):  # noqa: F811
    """While one request's prompt is being read (held here until the test lets it go), the router still answers
    another request: the read runs in a worker thread, not on the loop that relays every stream."""
    entered, release = threading.Event(), threading.Event()
    read = PromptReader.read

    def held_read(self, endpoint, body, scope):
        entered.set()
        assert release.wait(60), "the test never released the read"
        return read(self, endpoint, body, scope)

    monkeypatch.setattr(PromptReader, "read", held_read)
    replica = start_replica(tiny_model_dir)
    try:
        with live_router([replica.url], policy="prefix", api_key=None) as router:
            body = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": conversation(0, 1)[0]}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(httpx.post, f"{router.url}/v1/chat/completions", json=body, timeout=60)
                assert entered.wait(60)
                assert router.health().status_code == 200  # answered while the read is still held
                assert not held.done()
                release.set()
                assert held.result().status_code == 200
            assert router.fleet.policy.reasons["no_match"] == 1  # the read prompt reached the policy
    finally:
        release.set()
        replica.server.stop()
