"""The router and LoRA adapters. The prefix policy keys a prompt under the LoRA adapter its body's `model` names, as
a replica's cache keys it: the same prompt under two adapters (or an adapter and the base) is two keys, and a
conversation under one adapter sticks to the replica that holds that adapter's cache. Whatever the policy, a request
for an adapter goes only to replicas whose /health lists it, and an adapter's load or unload goes to every replica."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from pagoda.api.tenants import TenantTable
from pagoda.core.routing import RouteRequest, prompt_block_hashes
from pagoda.model.hub import resolve_model
from pagoda.plugins.manager import load_plugins, registered_endpoints
from pagoda.router.app import prompt_reader
from pagoda.router.policy import BuiltinPolicy, ReplicaState, RequestInfo
from pagoda.router.prompts import PromptReader, body_adapter
from pagoda.router.replicas import Fleet, Refused, adapter_names
from pagoda.router.settings import RouterSettings
from tests.helpers import FakeTokenizer, wait_for
from tests.lora_files import save_random_adapter
from tests.router.helpers import REPLICA_HEADER, live_router, served_by, start_replica
from tests.server_fixtures import TINY_NAME

ENDPOINTS = registered_endpoints(load_plugins({}))
SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
PROMPT = list(range(1, 41))  # ten 4-token blocks


def chat_body(model: str, text: str = "The same question, asked of every adapter in turn.") -> bytes:
    return f'{{"model": "{model}", "max_tokens": 3, "messages": [{{"role": "user", "content": "{text}"}}]}}'.encode()


def test_the_same_prompt_under_two_adapters_or_the_base_shares_no_block_key():
    base, x, y = (prompt_block_hashes(RouteRequest(PROMPT, adapter=a), 4) for a in (None, "x", "y"))
    assert len(base) == len(x) == len(y) == 10
    assert not set(base) & set(x) and not set(x) & set(y) and not set(base) & set(y)
    assert prompt_block_hashes(RouteRequest(PROMPT, adapter="x"), 4) == x  # the same adapter: the same keys
    salted = prompt_block_hashes(RouteRequest(PROMPT, cache_salt="s", adapter="x"), 4)
    assert not set(salted) & set(x)  # and the salt and tenant still count beside it


def test_the_reader_keys_a_prompt_under_the_adapter_its_model_names_and_any_other_name_as_the_base():
    served = {"x", "y"}
    reader = PromptReader(FakeTokenizer(), adapters=lambda: served)  # type: ignore[arg-type]
    chat = ENDPOINTS["chat"]
    read = {model: reader.read(chat, chat_body(model), SCOPE) for model in ("x", "y", "base-name", "alias")}
    assert {m: r.adapter for m, r in read.items()} == {"x": "x", "y": "y", "base-name": None, "alias": None}
    assert len({tuple(r.prompt_token_ids) for r in read.values()}) == 1  # one prompt, rendered alike
    keys = {m: tuple(prompt_block_hashes(r, 4)) for m, r in read.items()}
    assert len({keys["x"], keys["y"], keys["base-name"]}) == 3
    assert keys["base-name"] == keys["alias"]  # the base under any name: the replica runs the base on both
    served.discard("y")  # unloaded on every replica: its name is the base's again
    assert reader.read(chat, chat_body("y"), SCOPE).adapter is None
    messages = ENDPOINTS["messages"]  # Anthropic's protocol names its model the same way
    body = b'{"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}'
    assert reader.read(messages, body, SCOPE).adapter == "x"


def test_a_replicas_health_says_its_adapters_as_pagodas_health_lists_them():
    """pagoda's /health lists `lora_adapters` as objects with a name; one being unloaded is not served any more."""
    assert adapter_names({"status": "ok"}) == set()
    said = [{"name": "x", "rank": 8, "bytes": 4096, "target_modules": ["q_proj"], "unloading": False},
            {"name": "y", "unloading": True}, {"name": ""}, {"rank": 8}, "z", 3]
    assert adapter_names({"status": "ok", "lora_adapters": said}) == {"x"}
    assert adapter_names({"status": "ok", "lora_adapters": {"x": {}}}) == set()  # another shape: nothing read


def listed(*names: str) -> dict:
    """A replica's /health listing these adapters, as pagoda's /health lists them."""
    return {"status": "ok", "kv_block_size": 4, "kv_blocks_total": 64,
            "lora_adapters": [{"name": n, "rank": 8, "bytes": 1, "target_modules": [], "unloading": False}
                              for n in names]}


def test_the_fleets_adapters_are_every_replicas():
    fleet = Fleet(["http://127.0.0.1:1", "http://127.0.0.1:2"], BuiltinPolicy("prefix"), 4)
    assert fleet.adapter_names() == frozenset()
    fleet.replicas[0].health = listed("x")
    fleet.replicas[1].health = listed("y")
    assert fleet.adapter_names() == {"x", "y"}


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "power_of_two", "prefix"])
def test_a_request_for_an_adapter_is_admitted_only_where_a_replica_lists_it(policy):
    """Four replicas of two slots each, listing x, x and y, nothing, y: whatever the policy, x's requests fill
    replicas 0 and 1 and no other, then are refused (429) while y's and the base's still find room elsewhere."""
    fleet = Fleet([f"http://127.0.0.1:{i}" for i in range(1, 5)], BuiltinPolicy(policy), 2)
    for replica, names in zip(fleet.replicas, (["x"], ["x", "y"], [], ["y"])):
        replica.health, replica.healthy = listed(*names), True

    def fill(stack: ExitStack, adapter: str | None, n: int) -> set[int]:
        """Admit n requests for `adapter`, held in flight until `stack` closes: the replicas they took."""
        info = RequestInfo("POST", "/v1/chat/completions", "chat", adapter=adapter)
        return {stack.enter_context(fleet.admit(info)).index for _ in range(n)}

    with ExitStack() as stack:
        assert fill(stack, "x", 4) == {0, 1}
        with pytest.raises(Refused) as full:
            fill(stack, "x", 1)
        assert full.value.status == 429 and "'x'" in full.value.message
        assert fill(stack, "y", 2) == {3}  # replica 1, which lists y too, is full of x
        assert fill(stack, None, 2) == {2}  # the base model: any replica with room
    with ExitStack() as stack:
        assert fill(stack, "z", 8) == {0, 1, 2, 3}  # no replica lists it: any (its 404 is the replica's to answer)
    fleet.replicas[0].healthy = fleet.replicas[1].healthy = False  # x's replicas down: never sent where x is not
    with ExitStack() as stack:
        with pytest.raises(Refused) as down:
            fill(stack, "x", 1)
        assert down.value.status == 503 and "'x'" in down.value.message
        assert fill(stack, None, 4) == {2, 3}
    assert fleet.in_flight == 0


def test_the_adapter_a_body_names_is_read_without_rendering_its_prompt():
    assert body_adapter(chat_body("x"), {"x", "y"}) == "x"
    assert body_adapter(chat_body("base"), {"x"}) is None and body_adapter(chat_body("x"), set()) is None
    for body in (b"[1, 2]", b"not json", b'{"model": 3}', b"[" * 10000 + b"]" * 10000, b""):
        assert body_adapter(body, {"x"}) is None


def test_a_conversation_sticks_to_its_adapters_replica_and_another_adapters_same_prompt_goes_elsewhere():
    health = {"kv_block_size": 4, "kv_blocks_total": 64}
    replicas = [ReplicaState(i, f"http://r{i}", True, 0, 64, health) for i in range(3)]
    policy = BuiltinPolicy("prefix")

    def ask(adapter: str | None, extra: int = 0) -> int:
        prompt = RouteRequest(PROMPT + list(range(100, 100 + extra)), adapter=adapter)
        return policy.choose(replicas, RequestInfo("POST", "/v1/chat/completions", "chat", b"{}", prompt))

    first = {adapter: ask(adapter) for adapter in ("x", "y", None)}  # one prompt, three keys: three replicas
    assert sorted(first.values()) == [0, 1, 2]
    for turn in range(1, 4):  # each conversation's later turns (its prompt grown) follow its own cache
        assert {adapter: ask(adapter, 4 * turn) for adapter in ("x", "y", None)} == first
    assert policy.reasons == {"no_match": 3, "match": 9}


def test_the_routers_reader_asks_its_fleet_which_adapters_the_replicas_serve():
    settings = RouterSettings(("http://127.0.0.1:1",), model_dir=str(resolve_model("default", progress=False)))
    fleet = Fleet(settings.replicas, BuiltinPolicy("prefix"), 4)
    reader = prompt_reader(settings, load_plugins({}), TenantTable(), fleet)
    assert reader.read(ENDPOINTS["chat"], chat_body("x"), SCOPE).adapter is None  # no replica serves it yet
    fleet.replicas[0].health = listed("x")  # a poll's answer
    assert reader.read(ENDPOINTS["chat"], chat_body("x"), SCOPE).adapter == "x"


def test_live_a_conversation_under_an_adapter_sticks_to_its_replica_and_the_keys_are_the_engines(
        tiny_model_dir, tmp_path):
    """Two replicas serving adapters x and y: each conversation's turns go where its first went, the same
    conversation under the other adapter is no match there, and every hash the router holds for a replica is one
    that replica's cache registered (the router keyed each prompt under its adapter as the engine did)."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(str(tiny_model_dir)))
    modules = tuple((name, str(save_random_adapter(base, tmp_path / name, seed=seed, std=0.1)))
                    for seed, name in enumerate(("x", "y"), start=1))
    replicas = [start_replica(tiny_model_dir, num_blocks=256, lora_modules=modules, max_loras=2) for _ in range(2)]
    system = {"role": "system", "content": "You keep the records of a mountain pagoda; answer in one sentence. " * 3}
    try:
        with live_router([r.url for r in replicas], policy="prefix", api_key=None) as router:
            assert router.fleet.adapter_names() == {"x", "y"}  # from the replicas' first /health
            messages, where = [system], {}
            for turn in range(3):
                messages = [*messages, {"role": "user", "content": f"What is kept on tier {turn}?"}]
                for model in ("x", "y"):  # one conversation, asked of each adapter
                    body = {"model": model, "max_tokens": 3, "temperature": 0, "messages": messages}
                    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
                    assert r.status_code == 200 and r.json()["model"] == model, r.text
                    where.setdefault(model, set()).add(served_by(r, replicas))
                    if turn > 0:  # its earlier turns were cached under its adapter where it went
                        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
                messages = [*messages, {"role": "assistant", "content": f"Tier {turn} keeps scrolls."}]
            assert where == {"x": {0}, "y": {1}}  # y's first turn matched nothing at x's replica: the emptier one
            policy = router.fleet.policy
            assert policy.reasons == {"no_match": 2, "match": 4}
            for i, replica in enumerate(replicas):
                held = set(policy._inner._index[i])
                cached = set(replica.async_engine.engine.block_manager.cached_blocks)
                assert held and held <= cached, f"replica {i}: {len(held - cached)} of {len(held)} hashes unknown"
    finally:
        for replica in replicas:
            replica.server.stop()


def test_the_adapter_routes_are_the_servers():
    from pagoda.api.adapters import LOAD_PATH, UNLOAD_PATH
    from pagoda.router.proxy import ADAPTER_ROUTES

    assert ADAPTER_ROUTES == {LOAD_PATH, UNLOAD_PATH}


def test_live_a_load_reaches_every_replica_and_a_request_for_an_adapter_only_those_holding_it(
        tiny_model_dir, tmp_path):
    """Two replicas that load adapters while serving, behind a round-robin router: a load or unload through the
    router changes both (the router's view of them too, before it answers); one that fails somewhere answers the
    first failure and says which replicas changed; an adapter only one replica holds is asked of that one alone."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(str(tiny_model_dir)))
    paths = {name: str(save_random_adapter(base, tmp_path / name, seed=seed, std=0.1))
             for seed, name in enumerate(("z", "w", "v"), start=1)}
    replicas = [start_replica(tiny_model_dir, settings={"enable_lora_loading": True}, enable_lora_loading=True,
                              max_loras=2) for _ in range(2)]
    urls = [r.url for r in replicas]

    def load(url: str, name: str, path: str = "") -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path or paths[name]},
                          timeout=120)

    def ask(url: str, model: str) -> httpx.Response:
        body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r

    try:
        with live_router(urls, policy="round_robin", api_key=None) as router:
            r = load(router.url, "z")
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'z' added successfully.", r.text
            assert r.headers[REPLICA_HEADER] == ", ".join(urls)
            assert all("z" in replica.async_engine.adapters for replica in replicas)
            assert all("z" in adapter_names(replica.health) for replica in router.fleet.replicas)  # seen already

            r = load(router.url, "z")  # already loaded everywhere: the first failure, and nothing changed
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
            assert r.json()["replicas"] == [{"url": url, "status": 400, "changed": False} for url in urls]
            assert r.json()["error"]["message"].endswith("(sent to every healthy replica: none changed)")

            assert load(urls[0], "w").status_code == 200  # straight to the first replica
            r = load(router.url, "w")  # the first replica refuses it, the second loads it
            assert r.status_code == 400 and r.headers[REPLICA_HEADER] == urls[0], r.text
            assert r.json()["replicas"] == [{"url": urls[0], "status": 400, "changed": False},
                                            {"url": urls[1], "status": 200, "changed": True}]
            assert f"changed on {urls[1]}" in r.json()["error"]["message"]
            assert all("w" in replica.async_engine.adapters for replica in replicas)

            assert load(urls[1], "v").status_code == 200  # the second replica alone holds v
            wait_for(lambda: "v" in router.fleet.adapter_names(), "the router's poll to see v")
            assert {served_by(ask(router.url, "v"), replicas) for _ in range(4)} == {1}
            assert {served_by(ask(router.url, "z"), replicas) for _ in range(4)} == {0, 1}
            assert {served_by(ask(router.url, TINY_NAME), replicas) for _ in range(4)} == {0, 1}

            r = httpx.post(f"{router.url}/v1/unload_lora_adapter", json={"lora_name": "z"}, timeout=120)
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'z' removed successfully.", r.text
            assert not any("z" in replica.async_engine.adapters for replica in replicas)
            assert router.fleet.adapter_names() == {"w", "v"}
            assert router.in_flight() == [0, 0]
        with live_router(urls, policy="round_robin", api_key="router-key") as router:  # the router's key first
            r = load(router.url, "z")
            assert r.status_code == 401 and not any("z" in replica.async_engine.adapters for replica in replicas)
    finally:
        for replica in replicas:
            replica.server.stop()
