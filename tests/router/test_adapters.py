"""The prefix policy keys a prompt under the LoRA adapter its body's `model` names, as a replica's cache keys it:
the same prompt under two adapters (or an adapter and the base) is two keys, and a conversation under one adapter
sticks to the replica that holds that adapter's cache."""

from __future__ import annotations

import httpx
import pytest

from pagoda.api.tenants import TenantTable
from pagoda.core.routing import RouteRequest, prompt_block_hashes
from pagoda.model.hub import resolve_model
from pagoda.plugins.manager import load_plugins, registered_endpoints
from pagoda.router.app import prompt_reader
from pagoda.router.policy import BuiltinPolicy, ReplicaState, RequestInfo
from pagoda.router.prompts import PromptReader
from pagoda.router.replicas import Fleet, adapter_names
from pagoda.router.settings import RouterSettings
from tests.helpers import FakeTokenizer
from tests.lora_files import save_random_adapter
from tests.router.helpers import live_router, served_by, start_replica

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


@pytest.mark.parametrize(("said", "names"), [
    (None, set()),
    (["x", "y"], {"x", "y"}),
    ([{"name": "x", "rank": 8}, {"name": "y"}], {"x", "y"}),
    ({"x": {"rank": 8}}, {"x"}),
    ("x", set()),  # another shape: nothing read, as if it said nothing
    ([3, "", {"rank": 8}, "x"], {"x"}),
])
def test_a_replicas_health_says_its_adapters(said, names):
    health = {"status": "ok"} if said is None else {"status": "ok", "lora_adapters": said}
    assert adapter_names(health) == names


def test_the_fleets_adapters_are_every_replicas():
    fleet = Fleet(["http://127.0.0.1:1", "http://127.0.0.1:2"], BuiltinPolicy("prefix"), 4)
    assert fleet.adapter_names() == frozenset()
    fleet.replicas[0].health = {"status": "ok", "lora_adapters": ["x"]}
    fleet.replicas[1].health = {"status": "ok", "lora_adapters": [{"name": "y"}]}
    assert fleet.adapter_names() == {"x", "y"}


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
    fleet.replicas[0].health = {"status": "ok", "lora_adapters": ["x"]}  # a poll's answer
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
