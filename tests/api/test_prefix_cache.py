"""The prefix cache served: the official SDKs see cached prompt tokens on a repeated long request, the same text,
`cache_salt` and API-key tenants keep blocks apart, /metrics and /health count the hits, and --no-prefix-caching."""

from types import SimpleNamespace

import pytest

from pagoda.api.auth import offered_keys
from pagoda.api.tenants import TenantTable
from tests.helpers import metric_values
from tests.server_fixtures import TINY_ENGINE, TINY_NAME, start_server
from tests.server_fixtures import default_model_dir, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

# ~150 prompt tokens: several full blocks of 16 that a second identical request finds in the cache.
LONG = " ".join(f"Fact {i}: the pagoda on hill {i} has {i + 3} storeys and a bell." for i in range(12))
GREEDY = dict(max_tokens=12, temperature=0)


def block_floor(n: int) -> int:
    """The cached tokens a repeated n-token prompt gets at least: its full blocks but the one of its last token."""
    return (n - 1) // TINY_ENGINE["block_size"] * TINY_ENGINE["block_size"]


def test_openai_completions_reports_cached_tokens_on_a_repeat_with_the_same_text(tiny_server):
    client = tiny_server.openai()
    prompt = "Completions. " + LONG
    first = client.completions.create(model=tiny_server.model_name, prompt=prompt, **GREEDY)
    second = client.completions.create(model=tiny_server.model_name, prompt=prompt, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= block_floor(first.usage.prompt_tokens) > 0
    assert second.usage.prompt_tokens == first.usage.prompt_tokens  # OpenAI counts cached tokens as prompt tokens
    assert second.choices[0].text == first.choices[0].text


def test_openai_chat_reports_cached_tokens_unary_and_in_the_usage_chunk(tiny_server):
    client = tiny_server.openai()
    messages = [{"role": "system", "content": "Chat. " + LONG}, {"role": "user", "content": "Which hill?"}]
    first = client.chat.completions.create(model=tiny_server.model_name, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=tiny_server.model_name, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usage = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens >= block_floor(first.usage.prompt_tokens) > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content


def test_openai_responses_reports_cached_input_tokens(tiny_server):
    client = tiny_server.openai()
    kw = dict(model=tiny_server.model_name, instructions="Responses. " + LONG, input="Which hill?",
              max_output_tokens=12, temperature=0)
    first = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        second = s.get_final_response()
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= block_floor(first.usage.input_tokens) > 0
    assert second.output_text == first.output_text


def test_anthropic_reports_cache_read_input_tokens_unary_and_streamed(tiny_server):
    client = tiny_server.anthropic()
    kw = dict(model=tiny_server.model_name, max_tokens=12, system="Messages. " + LONG,
              messages=[{"role": "user", "content": "Which hill?"}], extra_body={"temperature": 0})
    first = client.messages.create(**kw)
    second = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        start = next(iter(s)).message.usage  # message_start
        third = s.get_final_message()
    prompt = first.usage.input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    for later in (second.usage, start, third.usage):
        assert later.cache_read_input_tokens >= block_floor(prompt) > 0
        assert later.input_tokens + later.cache_read_input_tokens == prompt  # Anthropic's split of the prompt
    assert second.content[0].text == third.content[0].text == first.content[0].text


def test_a_different_cache_salt_never_hits_and_the_same_one_does(tiny_server):
    client = tiny_server.openai()
    prompt = "Salted. " + LONG
    salted = [client.completions.create(model=tiny_server.model_name, prompt=prompt, extra_body={"cache_salt": s},
                                        **GREEDY) for s in ("a", "b", "a")]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in salted] == [False, False, True]
    assert len({r.choices[0].text for r in salted}) == 1


def test_an_empty_cache_salt_is_a_400_naming_it(tiny_server):
    with tiny_server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.text
        r = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "cache_salt": 3,
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "cache_salt" in r.text


def test_metrics_and_health_count_the_hits(tiny_server):
    client = tiny_server.openai()
    before = tiny_server.health()
    for _ in range(2):
        client.completions.create(model=tiny_server.model_name, prompt="Counted. " + LONG, **GREEDY)
    health = tiny_server.health()
    assert health["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] > 0
    assert health["prefix_cache_queried_tokens_total"] > health["prefix_cache_hit_tokens_total"]
    assert health["kv_blocks_cached_free"] > 0 and health["kv_blocks_free"] == health["kv_blocks_total"]
    values = metric_values(tiny_server.url)
    assert values["pagoda_prefix_cache_hits_tokens_total"] >= health["prefix_cache_hit_tokens_total"] > 0
    assert values["pagoda_prefix_cache_queries_tokens_total"] >= health["prefix_cache_queried_tokens_total"]
    assert "pagoda_kv_blocks_cached_free" in values


def test_the_tenant_is_a_hash_of_the_presented_key():
    def cache_key(api_key, **headers):
        tenant = TenantTable(api_key).match(offered_keys(SimpleNamespace(headers=headers)))
        return None if tenant is None else tenant.cache_key

    bearer = cache_key("k1", authorization="Bearer k1")
    assert bearer == cache_key("k1", **{"x-api-key": "k1"}) is not None  # either header, one tenant
    assert "k1" not in bearer
    assert cache_key("k2", authorization="Bearer k2") != bearer  # another key, another one
    assert TenantTable().match([]) is None and not TenantTable().needs_key  # no key set: no tenant
    assert cache_key("k1", authorization="Bearer wrong") is None


def test_a_keyed_server_still_shares_blocks_under_its_key(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "keyed", api_key="sekret", **TINY_ENGINE)
    try:
        client = live.openai()
        replies = [client.completions.create(model="keyed", prompt="Keyed. " + LONG, **GREEDY) for _ in range(2)]
        assert replies[1].usage.prompt_tokens_details.cached_tokens > 0
        assert replies[0].choices[0].text == replies[1].choices[0].text
    finally:
        live.server.stop()


def test_no_prefix_caching_never_reports_cached_tokens(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, TINY_NAME, enable_prefix_caching=False, **TINY_ENGINE)
    try:
        client = live.openai()
        replies = [client.completions.create(model=TINY_NAME, prompt="Uncached. " + LONG, **GREEDY) for _ in range(2)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0]
        assert replies[0].choices[0].text == replies[1].choices[0].text
        assert live.health()["prefix_cache_hit_tokens_total"] == 0
    finally:
        live.server.stop()


@pytest.mark.parametrize("argv, expected", [([], True), (["--no-prefix-caching"], False)])
def test_the_serve_flag_turns_the_cache_off(argv, expected):
    import argparse

    from pagoda.cli import generate, serve

    for command in (serve, generate):
        parser = argparse.ArgumentParser()
        command.register(parser.add_subparsers())
        name = command.__name__.rsplit(".", 1)[-1]
        args = parser.parse_args([name, *(["hi"] if name == "generate" else []), *argv])
        assert args.prefix_caching is expected
