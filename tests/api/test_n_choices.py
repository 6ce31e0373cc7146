"""Several choices over a live server with the official `openai` SDK: n > 1 and completions prompt lists."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import FaultySampler
from tests.server_fixtures import default_model_dir, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]
PROMPTS = ["Once upon a time", "The temple bell", "In the mountains"]
FAULT_SEED = 4242  # the fault hook below fails the sampling of requests with this seed


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.openai()


def chat(client, server, **kw):
    return client.chat.completions.create(model=server.model_name, messages=MESSAGES, **{"max_tokens": 12, **kw})


def complete(client, server, prompt, **kw):
    return client.completions.create(model=server.model_name, prompt=prompt, **{"max_tokens": 12, **kw})


def test_greedy_n_gives_n_identical_choices_equal_to_the_single_answer(client, tiny_server):
    solo = chat(client, tiny_server, temperature=0).choices[0].message.content
    reply = chat(client, tiny_server, temperature=0, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [solo] * 3
    assert reply.usage.completion_tokens == 3 * 12
    assert reply.usage.prompt_tokens == chat(client, tiny_server, temperature=0).usage.prompt_tokens  # once


def test_seeded_n_choices_equal_solo_runs_with_seed_plus_j(client, tiny_server):
    solos = [chat(client, tiny_server, temperature=1.0, seed=s).choices[0].message.content for s in (7, 8)]
    assert solos[0] != solos[1]  # the two seeds sample differently, so the equality below says something
    reply = chat(client, tiny_server, temperature=1.0, seed=7, n=2)
    assert [c.message.content for c in reply.choices] == solos
    completions = complete(client, tiny_server, PROMPTS[0], temperature=1.0, seed=7, n=2)
    assert [c.text for c in completions.choices] == [
        complete(client, tiny_server, PROMPTS[0], temperature=1.0, seed=s).choices[0].text for s in (7, 8)]


def test_a_prompt_list_gives_one_choice_per_prompt_equal_to_its_solo_answer(client, tiny_server):
    solos = [complete(client, tiny_server, p, temperature=0) for p in PROMPTS]
    reply = complete(client, tiny_server, PROMPTS, temperature=0)
    assert [(c.index, c.text) for c in reply.choices] == [(k, s.choices[0].text) for k, s in enumerate(solos)]
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solos)
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in solos)
    ids = [tiny_server.async_engine.engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    with_n = complete(client, tiny_server, ids, temperature=0, n=2)  # token-id prompts, index = prompt_i * n + j
    assert [c.text for c in with_n.choices] == [solos[0].choices[0].text] * 2 + [solos[1].choices[0].text] * 2


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_with_n_reassembles_to_the_unary_body(client, tiny_server, route):
    kw = dict(temperature=1.0, seed=3, n=2)
    ask = (lambda **k: chat(client, tiny_server, **kw, **k)) if route == "chat" else \
        (lambda **k: complete(client, tiny_server, PROMPTS[1], **kw, **k))
    unary = ask()
    chunks = list(ask(stream=True, stream_options={"include_usage": True}))
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += (choice.delta.content or "") if route == "chat" else choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    expected = [c.message.content if route == "chat" else c.text for c in unary.choices]
    assert [texts[0], texts[1]] == expected
    assert finishes == {0: ["length"], 1: ["length"]}  # one finish chunk per choice
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


def test_logprobs_come_per_choice(client, tiny_server):
    reply = chat(client, tiny_server, temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert [len(c.logprobs.content) for c in reply.choices] == [12, 12]
    assert reply.choices[0].logprobs.content[0].token == reply.choices[1].logprobs.content[0].token


def test_a_client_leaving_a_stream_with_n_aborts_every_choice(client, tiny_server):
    before = tiny_server.assert_pool_whole()
    stream = client.completions.create(model=tiny_server.model_name, prompt=PROMPTS[2], max_tokens=400, n=2,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen: set[int] = set()
    for chunk in stream:  # bounded: each choice has at most 400 tokens
        seen.update(c.index for c in chunk.choices if c.text)
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    stream.close()
    after = tiny_server.assert_pool_whole()  # waits for the engine to be idle: both requests ended
    assert after["aborted_total"] == before["aborted_total"] + 2


def test_one_failing_choice_fails_the_request_and_ends_the_others(client, tiny_server):
    engine = tiny_server.async_engine.engine
    original = engine.sampler
    engine.sampler = FaultySampler(original, lambda r: r.sampling_params.seed == FAULT_SEED)
    before = tiny_server.assert_pool_whole()
    client = client.with_options(max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError):  # choice 1 has seed FAULT_SEED: the unary answer is a 500
            chat(client, tiny_server, temperature=0.9, seed=FAULT_SEED - 1, n=2, max_tokens=200,
                 extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="injected sampling fault"):  # the stream's error event
            list(chat(client, tiny_server, temperature=0.9, seed=FAULT_SEED - 1, n=2, max_tokens=200, stream=True,
                      extra_body={"ignore_eos": True}))
    finally:
        engine.sampler = original
    after = tiny_server.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"] + 2  # each request's healthy choice, ended with it
