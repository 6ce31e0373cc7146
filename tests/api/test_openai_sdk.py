"""The three OpenAI endpoints against a live server, with the official `openai` SDK as the client."""

import httpx
import openai
import pytest

from tests.server_fixtures import default_model_dir, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]
PROMPT = "Once upon a time, in a pagoda"


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.openai()


@pytest.fixture(scope="module")
def chat_reference(client, tiny_server):
    """The greedy unary chat reply to MESSAGES (24 tokens), and a stop string from its middle."""
    reply = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=24,
                                           temperature=0)
    text = reply.choices[0].message.content
    stop = _middle(text)
    return reply, text, stop


def _middle(text: str) -> str:
    """A 3-character stop string from the middle of `text`, whose first occurrence is that one."""
    for k in range(len(text) // 2, len(text) - 3):
        candidate = text[k : k + 3]
        if candidate.strip() and text.find(candidate) == k:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def _chat_prompt_tokens(server) -> int:
    return len(server.async_engine.engine.tokenizer.encode_chat(MESSAGES))


# -- chat completions ---------------------------------------------------------------------------
def test_chat_unary_body_and_usage(chat_reference, tiny_server):
    reply, text, _ = chat_reference
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == tiny_server.model_name
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and text
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 24
    assert reply.usage.prompt_tokens == _chat_prompt_tokens(tiny_server)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24


def test_chat_stream_equals_unary_and_reports_usage_last(client, chat_reference, tiny_server):
    reply, text, _ = chat_reference
    chunks = list(client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: found in the prefix cache
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5  # it really streamed


def test_chat_stop_sequence_cuts_the_text_in_every_mode(client, chat_reference, tiny_server):
    _, text, stop = chat_reference
    expected = text[: text.index(stop)]
    reply = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=24,
                                           temperature=0, stop=[stop, "never-matches"])
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 24
    with client.chat.completions.stream(model=tiny_server.model_name, messages=MESSAGES, max_tokens=24,
                                        temperature=0, stop=stop) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == expected and final.choices[0].finish_reason == "stop"


def test_chat_stream_helper_raises_on_a_length_cut_off_as_the_sdk_does(client, tiny_server):
    kw = dict(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5, temperature=0)
    with client.chat.completions.stream(**kw) as s:
        with pytest.raises(openai.LengthFinishReasonError):
            s.get_final_completion()


def test_chat_logprobs_unary_and_stream(client, chat_reference, tiny_server):
    _, text, _ = chat_reference
    kw = dict(model=tiny_server.model_name, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
              top_logprobs=3)
    reply = client.chat.completions.create(**kw)
    content = reply.choices[0].logprobs.content
    assert len(content) == 8 and "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top token was chosen
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_seeded_sampling_repeats_and_differs_by_seed(client, tiny_server):
    def sample(seed):
        return client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=12,
                                              temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_extension_fields_are_honoured(client, tiny_server):
    base = dict(model=tiny_server.model_name, messages=MESSAGES, max_tokens=12)
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content

    def sample(**extra):
        reply = client.chat.completions.create(**base, temperature=1.0, seed=3, extra_body=extra)
        return reply.choices[0].message.content

    assert sample() != greedy  # plain sampling wanders off the greedy path...
    assert sample(top_k=1) == greedy  # ...top_k=1 and min_p=1 leave only the most likely token
    assert sample(min_p=1.0) == greedy
    assert sample(repetition_penalty=1.3, ignore_eos=True, top_k=-1)  # accepted (-1 = off, as vLLM has it)


# -- completions ---------------------------------------------------------------------------------
def test_completions_unary_stream_echo_and_token_prompts_agree(client, tiny_server):
    kw = dict(model=tiny_server.model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    reply = client.completions.create(**kw)
    text = reply.choices[0].text
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 16
    ids = tiny_server.async_engine.engine.tokenizer.encode(PROMPT)
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "length"
    assert client.completions.create(**{**kw, "prompt": ids}).choices[0].text == text
    assert client.completions.create(**{**kw, "prompt": [PROMPT]}).choices[0].text == text
    assert client.completions.create(**kw, echo=True).choices[0].text == PROMPT + text
    echoed = list(client.completions.create(**kw, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in echoed) == PROMPT + text


def test_completions_logprobs(client, tiny_server):
    reply = client.completions.create(model=tiny_server.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()))


def test_completions_echo_with_logprobs_scores_the_prompt_unary_stream_and_alone(client, tiny_server):
    """echo + logprobs: the prompt's tokens and logprobs (the first null), then the answer's, as the SDK reads them;
    the stream sends the echoed prompt first; max_tokens 0 scores the prompt alone, with the same values."""
    kw = dict(model=tiny_server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    ids = tiny_server.async_engine.engine.tokenizer.encode(PROMPT)
    reply = client.completions.create(**kw)
    choice, lp = reply.choices[0], reply.choices[0].logprobs
    assert choice.text.startswith(PROMPT) and reply.usage.completion_tokens == 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(PROMPT)  # the answer's offsets count from the echoed prompt's end
    assert all(chosen <= max(top.values()) for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    answer = client.completions.create(**{**kw, "echo": False}).choices[0]
    assert choice.text == PROMPT + answer.text and lp.token_logprobs[len(ids):] == answer.logprobs.token_logprobs

    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].text == PROMPT and len(chunks[0].choices[0].logprobs.tokens) == len(ids)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs

    scored = client.completions.create(**{**kw, "max_tokens": 0}).choices[0]
    assert scored.text == PROMPT and scored.finish_reason == "length"
    assert scored.logprobs.token_logprobs == lp.token_logprobs[: len(ids)]


def test_prompt_logprobs_on_completions_and_chat(client, tiny_server):
    """vLLM's `prompt_logprobs`: per prompt token its own logprob and rank and the top N, by token id."""
    ids = tiny_server.async_engine.engine.tokenizer.encode(PROMPT)
    reply = client.completions.create(model=tiny_server.model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=1, echo=True, extra_body={"prompt_logprobs": 3})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    echoed = reply.choices[0].logprobs.token_logprobs
    for position, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[position])]
        assert own["logprob"] == echoed[position] and own["rank"] >= 1
        assert 3 <= len(entry) <= 4 and sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    chat = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])
    chunks = list(client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=2,
                                                 temperature=0, stream=True, extra_body={"prompt_logprobs": 0}))
    streamed = [c.model_extra["prompt_logprobs"] for c in chunks if c.model_extra.get("prompt_logprobs")]
    assert streamed == [entries]


def test_omitted_max_tokens_fills_the_context(client, tiny_server):
    context = tiny_server.async_engine.engine.config.max_model_len
    prompt = [(7 * i) % 1000 + 100 for i in range(context - 20)]
    reply = client.completions.create(model=tiny_server.model_name, prompt=prompt, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 20 and reply.usage.total_tokens == context


def test_completions_stream_reports_usage_when_asked(client, tiny_server):
    chunks = list(client.completions.create(model=tiny_server.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


# -- responses -----------------------------------------------------------------------------------
def test_responses_unary_matches_chat_and_reports_incomplete(client, chat_reference, tiny_server):
    _, text, _ = chat_reference
    r = client.responses.create(model=tiny_server.model_name, input=MESSAGES[0]["content"], max_output_tokens=24,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == text  # the same conversation through the same template
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == _chat_prompt_tokens(tiny_server) and r.usage.output_tokens == 24
    assert r.usage.total_tokens == r.usage.input_tokens + 24


def test_responses_stream_helper_and_event_sequence(client, chat_reference, tiny_server):
    _, text, stop = chat_reference
    with client.responses.stream(model=tiny_server.model_name, input=MESSAGES, max_output_tokens=24,
                                 temperature=0, extra_body={"stop": [stop]}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == text[: text.index(stop)] and final.status == "completed"
    raw = events
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    kinds = [e.type for e in raw]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == final.output_text


def test_responses_instructions_and_extension_fields(client, tiny_server):
    kw = dict(model=tiny_server.model_name, input="Hello", max_output_tokens=8, temperature=0)
    instructed = client.responses.create(**kw, instructions="Answer in French.")
    tokenizer = tiny_server.async_engine.engine.tokenizer
    conversation = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    assert instructed.usage.input_tokens == len(tokenizer.encode_chat(conversation))  # the system message is in
    seeded = [client.responses.create(**{**kw, "temperature": 1.0}, extra_body={"seed": 3, "top_k": 50}).output_text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}, "model"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "n": 129}, "n"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "x", "guided_regex": "\U00040000"}, "guided_regex"),  # no token has it
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4, "guided_regex": "0\U00040000"}, "guided_regex"),
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": [5] * 5000, "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"model": "m", "input": "x", "top_logprobs": 99}, "top_logprobs"),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0]"),
])
def test_a_bad_field_is_a_400_naming_it_in_openais_shape(tiny_server, path, body, param):
    r = httpx.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0] in error["message"]
    assert "Traceback" not in r.text


def test_errors_reach_the_sdk_as_its_exception_and_the_server_keeps_serving(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5000)
    assert info.value.body["code"] == "context_length_exceeded" and "context" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tiny_server.model_name, prompt=[10**9], max_tokens=2)  # outside the vocabulary
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5000,
                                            stream=True))
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    tiny_server.assert_pool_whole()


def test_models_list_and_retrieve(client, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_server.model_name]
    assert client.models.retrieve(tiny_server.model_name).id == tiny_server.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
