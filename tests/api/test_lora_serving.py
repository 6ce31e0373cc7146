"""LoRA adapters served as models: chosen by name on every protocol (the official SDKs), listed by /v1/models with
their parent, loaded and unloaded live through vLLM's routes (an unload waits for the adapter's requests in flight,
/health saying so; a name reloaded from another directory answers as that adapter), malformed adapters refused with
a 400 naming the field (a path that does not exist: 404), tenants limited to some adapters, only keys that may
manage adapters loading them, /health (which names no path) and /metrics.

One live server on the tiny model serves the whole module (keys, --enable-lora-loading, two start-up adapters);
the adapters are made by the peft library over a transformers Llama of the tiny model's shapes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from pagoda.api.settings import ServeSettings
from tests.helpers import metric_values, wait_for
from tests.lora_files import edit_config, save_random_adapter
from tests.server_fixtures import TINY_ENGINE, start_server, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NAME = "tiny-base"
KEYS = {"full": "key-full-3b9d", "limited": "key-limited-8e21", "user": "key-user-51c0"}
B_PARENT = "org/b-base"  # vLLM's base_model_name given for b (--lora-modules' JSON form): its card's parent
MESSAGES = [{"role": "user", "content": "Tell me about the pagoda on the hill."}]
PROMPT = "Once upon a time, in a pagoda"
MAX_TOKENS = 12
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def hf_of(model_dir: Path, **config_changes):
    """A transformers Llama of the model's shapes (random weights: an adapter only needs the shapes)."""
    config = transformers.LlamaConfig.from_pretrained(str(model_dir))
    for name, value in config_changes.items():
        setattr(config, name, value)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """Directories: two good adapters and each malformed one, by name."""
    root = tmp_path_factory.mktemp("adapters")
    base = hf_of(tiny_model_dir)
    made = {"a": save_random_adapter(base, root / "a", seed=1, std=0.1),
            "b": save_random_adapter(base, root / "b", seed=2, std=0.1),
            "high_rank": save_random_adapter(base, root / "high_rank", rank=32, alpha=32, seed=3)}
    made["other_shape"] = save_random_adapter(hf_of(tiny_model_dir, hidden_size=128), root / "other_shape", seed=4)
    for kind in ("unknown_module", "nan", "dora", "modules_to_save"):
        made[kind] = save_random_adapter(base, root / kind, seed=5)
    _rewrite_tensors(made["unknown_module"], lambda key: key.replace(".layers.0.self_attn.q_proj.",
                                                                     ".layers.0.self_attn.c_attn."))
    _rewrite_tensors(made["nan"], nan_key=NAN_KEY)
    edit_config(made["dora"], use_dora=True)
    edit_config(made["modules_to_save"], modules_to_save=["lm_head"])
    return made


NAN_KEY = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"


def _rewrite_tensors(directory: Path, rename=lambda key: key, nan_key: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    assert nan_key is None or nan_key in tensors, sorted(tensors)
    out = {}
    for key, tensor in tensors.items():
        if key == nan_key:
            tensor = tensor.clone()
            tensor[0, 0] = float("nan")
        out[rename(key)] = tensor.contiguous()
    save_file(out, str(path))


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):  # noqa: F811
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "full", "key_sha256": sha(KEYS["full"]), "manage_adapters": True},
        {"name": "limited", "key_sha256": sha(KEYS["limited"]), "adapters": ["a"]},
        {"name": "user", "key_sha256": sha(KEYS["user"])}]}))
    settings = ServeSettings(api_keys_file=str(keys), enable_lora_loading=True, lora_parents=(("b", B_PARENT),))
    live = start_server(tiny_model_dir, NAME, settings=settings, refuse_unknown_models=True,
                        lora_modules=(("a", str(adapters["a"])), ("b", str(adapters["b"]))), max_loras=2,
                        **TINY_ENGINE)
    live.api_key = KEYS["full"]
    try:
        yield live
    finally:
        live.server.stop()


def chat(client: openai.OpenAI, model: str, **kw) -> tuple[str, str]:
    """(text, model reported) of a greedy chat completion, unary; streamed with stream=True."""
    if kw.pop("stream", False):
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **GREEDY, **kw))
        assert {c.model for c in chunks} == {model}
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[0].model
    reply = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY, **kw)
    return reply.choices[0].message.content, reply.model


def complete(client: openai.OpenAI, model: str, stream: bool = False) -> tuple[str, str]:
    if stream:
        chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
        assert {c.model for c in chunks} == {model}
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[0].model
    reply = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    return reply.choices[0].text, reply.model


def message(client: anthropic.Anthropic, model: str, stream: bool = False) -> tuple[str, str]:
    if stream:
        with client.messages.stream(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                    extra_body={"temperature": 0}) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        return text, final.model
    reply = client.messages.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    return "".join(b.text for b in reply.content if b.type == "text"), reply.model


@pytest.mark.parametrize("ask", [chat, complete, message], ids=["chat", "completions", "messages"])
def test_each_sdk_chooses_an_adapter_by_name_stream_and_unary(server, ask):
    client = server.anthropic() if ask is message else server.openai()
    texts = {}
    for model in (NAME, "a", "b"):
        unary, reported = ask(client, model)
        assert reported == model  # the adapter's name is the response's model
        assert ask(client, model, stream=True) == (unary, model)  # the stream says what the unary answer says
        assert ask(client, model)[0] == unary  # and the same request twice gives the same text
        texts[model] = unary
    assert len(set(texts.values())) == 3, texts  # each adapter changes the answer, and the two differently
    server.assert_pool_whole()


def test_an_adapter_on_the_ollama_plugins_routes(server):
    body = {"model": "a", "messages": MESSAGES, "stream": False, "options": {"temperature": 0, "num_predict": 12}}
    headers = {"authorization": f"Bearer {KEYS['full']}"}
    reply = httpx.post(f"{server.url}/api/chat", json=body, headers=headers, timeout=60).json()
    assert reply["model"] == "a" and reply["message"]["content"] == chat(server.openai(), "a")[0]
    missing = httpx.post(f"{server.url}/api/chat", json={**body, "model": "nope"}, headers=headers, timeout=60)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]


def test_models_lists_each_adapter_with_its_parent(server, adapters):
    listed = {m.id: m for m in server.openai().models.list().data}
    assert list(listed)[0] == NAME and sorted(listed) == sorted([NAME, "a", "b"])
    for name, parent in (("a", NAME), ("b", B_PARENT)):  # the served name, or the base_model_name it was given
        card = listed[name].model_dump()
        assert card["parent"] == parent and card["root"] == str(adapters[name]) and card["object"] == "model"
        assert server.openai().models.retrieve(name).model_dump()["parent"] == parent
    assert "parent" not in listed[NAME].model_dump()
    assert sorted(m.id for m in server.anthropic().models.list().data) == sorted([NAME, "a", "b"])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.openai().models.retrieve("nope")


def test_an_unknown_model_is_404_on_every_protocol_naming_the_adapters(server):
    with pytest.raises(openai.NotFoundError) as chat_error:
        server.openai().chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert chat_error.value.body["code"] == "model_not_found" and "'a', 'b'" in chat_error.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        server.openai().completions.create(model="nope", prompt=PROMPT, max_tokens=2, stream=True)
    with pytest.raises(openai.NotFoundError):
        server.openai().responses.create(model="nope", input="Hi", max_output_tokens=2)
    with pytest.raises(anthropic.NotFoundError, match="'a', 'b'"):
        server.anthropic().messages.create(model="nope", messages=MESSAGES, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic().messages.count_tokens(model="nope", messages=MESSAGES)
    assert server.anthropic().messages.count_tokens(model="a", messages=MESSAGES).input_tokens > 5
    with server.http() as http:
        headers = {"authorization": f"Bearer {KEYS['full']}"}
        assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}, headers=headers).status_code == 404
        assert http.post("/tokenize", json={"model": "b", "prompt": "x"}, headers=headers).status_code == 200


def test_health_and_metrics_count_the_adapters_memory_and_health_says_no_path(server, adapters):
    with server.http() as http:
        r = http.get("/health")  # open: no key asked
    health = r.json()
    listed = {a["name"]: a for a in health["lora_adapters"]}
    assert set(listed) == {"a", "b"} and listed["a"]["rank"] == 8
    assert set(listed["a"]) == {"name", "rank", "bytes", "target_modules", "unloading"}
    assert listed["a"]["unloading"] is False
    assert str(adapters["a"].parent) not in r.text  # where the adapters live is not told
    assert health["lora_adapters_loaded"] == 2 and health["lora_adapter_bytes"] == sum(
        a["bytes"] for a in listed.values()) > 0
    metrics = metric_values(server.url)
    assert metrics["pagoda_lora_adapters_loaded"] == 2
    assert metrics["pagoda_lora_adapter_bytes"] == health["lora_adapter_bytes"]


def test_a_tenant_limited_to_one_adapter_does_not_see_the_other(server, adapters):
    limited = server.openai(api_key=KEYS["limited"])
    assert chat(limited, "a") == chat(server.openai(), "a")
    assert chat(limited, NAME)[1] == NAME  # the base model stays allowed
    with pytest.raises(openai.NotFoundError) as refused:
        limited.chat.completions.create(model="b", messages=MESSAGES, max_tokens=2)
    assert "'b'" not in refused.value.body["message"].partition("serves")[2]  # the other adapter is not named
    assert [m.id for m in limited.models.list().data] == [NAME, "a"]
    with pytest.raises(openai.NotFoundError):
        limited.models.retrieve("b")
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic(api_key=KEYS["limited"]).messages.create(model="b", messages=MESSAGES, max_tokens=2)
    with server.http() as http:  # nor may it tokenize for it
        r = http.post("/tokenize", json={"model": "b", "prompt": "x"},
                      headers={"authorization": f"Bearer {KEYS['limited']}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("tenant", ["limited", "user"])
def test_only_a_key_that_may_manage_adapters_loads_or_unloads_them(server, adapters, tenant):
    """A keys-file tenant not marked manage_adapters gets 403 naming lora_name on both routes, limited to some
    adapters or not, for an adapter it may use too: another tenant's adapter is not its to change."""
    with server.http() as http:
        key = {"authorization": f"Bearer {KEYS[tenant]}"}
        for path, body in (("/v1/unload_lora_adapter", {"lora_name": "a"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "b"}),
                           ("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["b"])}),
                           ("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/no/such/dir"})):
            r = http.post(path, json=body, headers=key)
            assert r.status_code == 403, (path, body, r.text)
            error = r.json()["error"]
            assert error["param"] == "lora_name" and error["code"] == "permission_denied", error
    assert set(server.async_engine.adapters) == {"a", "b"}


def test_the_keys_file_may_limit_a_tenant_to_some_adapters_and_is_strict_about_it():
    from pagoda.api.keys_file import KeysFileError, parse_keys

    entry = {"name": "t", "key_sha256": sha("k")}

    def tenant(**fields):
        return parse_keys(json.dumps({"tenants": [{**entry, **fields}]}), ".json")[0]

    assert tenant(adapters=["a"]).may_use("a") and not tenant(adapters=["a"]).may_use("b")
    assert tenant().may_use("b") and not tenant(adapters=[]).may_use("a")  # absent: all; []: the base only
    (toml,) = parse_keys(f'[[tenants]]\nname = "t"\nkey_sha256 = "{sha("k")}"\nadapters = ["a"]\n', ".toml")
    assert toml.adapters == frozenset({"a"})
    for bad in ("a", [1], [""], {"a": 1}):
        with pytest.raises(KeysFileError, match=r"tenants\[0\]\.adapters"):
            tenant(adapters=bad)
    assert tenant(manage_adapters=True).manage_adapters and not tenant(adapters=["a"]).manage_adapters


def test_the_loading_routes_need_a_key(server, adapters):
    with server.http() as http:
        schema = http.get("/schema").json()  # and are in the OpenAPI schema, with vLLM's bodies
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(schema["paths"])
        assert set(schema["components"]["schemas"]["LoadLoraAdapterRequest"]["properties"]) == {"lora_name",
                                                                                               "lora_path"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = http.post(path, json={"lora_name": "a", "lora_path": str(adapters["a"])})
            assert r.status_code == 401, r.text
            r = http.post(path, json={"lora_name": "a", "lora_path": str(adapters["a"])},
                          headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401, r.text
    assert set(server.async_engine.adapters) == {"a", "b"}


def test_the_loading_routes_are_not_served_without_the_flag(tiny_server, adapters):  # noqa: F811
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(f"{tiny_server.url}{path}", json={"lora_name": "a", "lora_path": str(adapters["a"])},
                       timeout=60)
        assert r.status_code == 404, r.text
    assert tiny_server.health()["lora_adapters"] == []


MALFORMED = [  # (adapter, the field the 400 names)
    ("not_a_directory", "lora_path"),
    ("high_rank", "r"),
    ("other_shape", "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"),  # 128 outputs, not 64
    ("unknown_module", "target_modules"),
    ("nan", NAN_KEY),
    ("dora", "use_dora"),
    ("modules_to_save", "modules_to_save"),
]


def test_malformed_adapters_are_refused_naming_the_field(server, adapters, tmp_path):
    (tmp_path / "a-file").write_text("not an adapter")
    paths = {**adapters, "not_a_directory": tmp_path / "a-file"}
    with server.http() as http:
        headers = {"authorization": f"Bearer {KEYS['full']}"}
        # a path that does not exist: 404, as vLLM answers it (NotFoundError)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(tmp_path / "nothing-here")},
                      headers=headers)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text
        for kind, field in MALFORMED:
            r = http.post("/v1/load_lora_adapter", json={"lora_name": kind, "lora_path": str(paths[kind])},
                          headers=headers)
            assert r.status_code == 400, (kind, r.text)
            error = r.json()["error"]
            assert error["param"] == field, (kind, error)
        # names a request could not reach, or already served, and bodies that are not vLLM's
        for body, field in [({"lora_name": NAME, "lora_path": str(adapters["a"])}, "lora_name"),
                            ({"lora_name": "a", "lora_path": str(adapters["b"])}, "lora_name"),
                            ({"lora_name": "", "lora_path": str(adapters["a"])}, "lora_name"),
                            ({"lora_name": " c", "lora_path": str(adapters["a"])}, "lora_name"),
                            ({"lora_name": "c"}, "lora_path"),
                            ({"lora_name": 7, "lora_path": str(adapters["a"])}, "lora_name")]:
            r = http.post("/v1/load_lora_adapter", json=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=headers)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name", r.text
    assert set(server.async_engine.adapters) == {"a", "b"}
    assert chat(server.openai(), "a")[1] == "a" and chat(server.openai(), NAME)[1] == NAME  # still serving
    server.assert_pool_whole()


class SlowSteps:
    """The engine's runner, each step `delay` seconds longer: requests that stay in flight while the test acts."""

    def __init__(self, runner, delay: float) -> None:
        self.runner = runner
        self.delay = delay

    def execute(self, batch):
        threading.Event().wait(self.delay)
        return self.runner.execute(batch)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_unloading_while_requests_run_waits_for_them_then_a_reload_serves_the_same(server, adapters):
    client = server.openai()
    long = dict(max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    expected = client.chat.completions.create(model="a", messages=MESSAGES, **long).choices[0].message.content
    engine = server.async_engine.engine
    users_at_unload: list[int] = []
    unload = engine.unload_adapter

    def watched_unload(name):  # on the engine's thread: how many requests of the adapter are in flight then
        users_at_unload.append(engine.adapters.users[name])
        return unload(name)

    streams = 3
    texts: list[str | None] = [None] * streams
    started = [threading.Event() for _ in range(streams)]

    def stream(i: int) -> None:
        parts = []
        for chunk in client.chat.completions.create(model="a", messages=MESSAGES, stream=True, **long):
            started[i].set()
            parts.extend(c.delta.content or "" for c in chunk.choices)
        texts[i] = "".join(parts)

    unloaded: list[httpx.Response] = []

    def unload_a() -> None:
        unloaded.append(httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": 1},
                                   headers={"authorization": f"Bearer {KEYS['full']}"}, timeout=120))

    healthy = engine.runner
    engine.runner = SlowSteps(healthy, 0.025)  # read by the loop thread at its next step: ~1.6 s a request
    engine.unload_adapter = watched_unload
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    unloader = threading.Thread(target=unload_a)
    try:
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(60), "a stream never started"
        unloader.start()
        wait_for(lambda: bool(users_at_unload), "the unload to reach the engine")
        # from now on the adapter is gone for new requests, while its requests in flight run on
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=2)
        assert "a" not in [m.id for m in client.models.list().data]
        # /health still counts its memory, and says it is being unloaded
        wait_for(lambda: server.health()["lora_adapters_in_use"] == 1, "a stats turn after the unload began")
        health = server.health()
        assert {a["name"]: a["unloading"] for a in health["lora_adapters"]} == {"a": True, "b": False}
        assert health["lora_adapters_loaded"] == 2
        assert health["lora_adapter_bytes"] == sum(a["bytes"] for a in health["lora_adapters"])
        unloader.join(120)
        for t in threads:
            t.join(120)
    finally:
        engine.runner = healthy
        del engine.unload_adapter
    assert users_at_unload == [streams]  # every stream was in flight when the unload began...
    assert unloaded[0].status_code == 200 and unloaded[0].text == "Success: LoRA adapter 'a' removed successfully."
    assert texts == [expected] * streams  # ... and each ran to its whole answer
    stats = server.assert_pool_whole()
    assert stats["lora_adapters_loaded"] == 1 and stats["lora_adapters_in_use"] == 0
    assert [a["name"] for a in server.health()["lora_adapters"]] == ["b"]

    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])},
                   headers={"authorization": f"Bearer {KEYS['full']}"}, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    assert client.chat.completions.create(model="a", messages=MESSAGES, **long).choices[0].message.content == expected
    server.assert_pool_whole()


def test_a_name_reloaded_from_another_adapters_directory_answers_as_that_adapter(server, adapters):
    """Unload a, load a from b's directory: every protocol's answers under a are b's, its card's root b's directory,
    and none of the blocks cached under the first a serves it (the same prompts, asked again)."""
    client, headers = server.openai(), {"authorization": f"Bearer {KEYS['full']}"}
    asks = [(chat, client), (complete, client), (message, server.anthropic())]
    before = {ask.__name__: ask(c, "a")[0] for ask, c in asks}  # cached under a's first load
    as_b = {ask.__name__: ask(c, "b")[0] for ask, c in asks}
    assert before != as_b

    def reload(path: Path) -> None:
        with server.http() as http:
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=headers).status_code == 200
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)}, headers=headers)
            assert r.status_code == 200, r.text

    reload(adapters["b"])
    try:
        assert {ask.__name__: ask(c, "a")[0] for ask, c in asks} == as_b
        assert client.models.retrieve("a").model_dump()["root"] == str(adapters["b"])
    finally:
        reload(adapters["a"])  # as the module's other tests expect it
    assert {ask.__name__: ask(c, "a")[0] for ask, c in asks} == before
    server.assert_pool_whole()
