"""The prefix policy live: the router renders each prompt as a replica does, keys on the prefix cache's own
block hashes, and so sends a conversation's turns where its blocks are cached.

The proof that the router's keys are the engine's keys: every block hash the router's index holds for a
replica is a hash that replica's block manager has cached, for chat and Anthropic requests, under an API key
(the tenant seeds the chain) and a `cache_salt`. If the router rendered, tokenized or keyed differently from
the replica, none would be.
"""

from __future__ import annotations

import httpx

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
