"""POST /v1/chat/completions without a server: prepare, render, render_stream, errors and the client half."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.request_fields import RequestError
from tests.helpers import (
    completion,
    context,
    outputs,
    prepared,
    read_stream,
    read_unary,
    stream,
)

ENDPOINT = ChatCompletions()
MESSAGES = [{"role": "user", "content": "hi"}]


def body(**fields):
    return {"model": "m", "messages": MESSAGES, **fields}


def test_messages_reach_the_template_as_role_and_text():
    ctx = context()
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}]
    call = prepared(ENDPOINT, body(messages=messages), ctx)
    assert ctx.tokenizer.chats == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                    {"role": "assistant", "content": ""}]]
    assert call.request.prompt_token_ids == ctx.tokenizer.encode("<system>be brief<user>a\nb<assistant><assistant>")


def test_max_completion_tokens_wins_and_logprobs_map():
    call = prepared(ENDPOINT, body(max_tokens=9, max_completion_tokens=4, logprobs=True, top_logprobs=3))
    p = call.request.sampling_params
    assert p.max_tokens == 4 and p.logprobs == 3
    assert prepared(ENDPOINT, body(logprobs=True)).request.sampling_params.logprobs == 0
    assert prepared(ENDPOINT, body()).request.sampling_params.logprobs is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 129}, "n"),
    ({"stop": ""}, "stop"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(**fields))
    assert info.value.param == param


def test_a_model_without_a_chat_template_is_refused():
    ctx = context()
    ctx.tokenizer.has_chat_template = False
    with pytest.raises(RequestError, match="no chat template"):
        prepared(ENDPOINT, body(), ctx)


def test_render_gives_the_assistant_message_finish_reason_and_usage():
    call = prepared(ENDPOINT, body())
    reply = ENDPOINT.render(call, completion(call, ["Hi", "!"], reason=FinishReason.STOP))
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    assert reply["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi!", "refusal": None},
                                 "finish_reason": "stop", "logprobs": None}]
    assert reply["usage"]["completion_tokens"] == 2 and reply["usage"]["prompt_tokens"] == call.num_prompt_tokens


def test_logprobs_are_per_token_with_alternatives():
    call = prepared(ENDPOINT, body(logprobs=True, top_logprobs=1))
    content = ENDPOINT.render(call, completion(call, ["A"], logprobs=True))["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "A", "logprob": -0.5, "bytes": [65],
                        "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]},
                                         {"token": "B", "logprob": -1.5, "bytes": [66]}]}]


def test_the_stream_is_role_content_finish_usage_done():
    call = prepared(ENDPOINT, body(stream=True, stream_options={"include_usage": True}))
    events = stream(ENDPOINT, call, outputs(call, ["a", "b"]))
    deltas = [e.data["choices"][0]["delta"] for e in events[:4]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {}]
    assert [e.data["choices"][0]["finish_reason"] for e in events[:4]] == [None, None, None, "length"]
    assert all(e.data["usage"] is None for e in events[:4])  # include_usage: every chunk has the key
    assert events[4].data["choices"] == [] and events[4].data["usage"]["completion_tokens"] == 2
    assert events[5].data == "[DONE]" and len(events) == 6


def test_the_client_half_asks_what_the_server_half_prepares_and_reads_what_it_renders():
    ctx = context()
    ask = ClientRequest("abc", 2, stream=True, temperature=0.5, seed=1, ignore_eos=True, model="m")
    call = prepared(ENDPOINT, ENDPOINT.client_request(ask), ctx)
    p = call.request.sampling_params
    assert ctx.tokenizer.chats == [[{"role": "user", "content": "abc"}]]
    assert (p.max_tokens, p.temperature, p.seed, p.ignore_eos) == (2, 0.5, 1, True) and call.body.include_usage
    streamed = read_stream(ENDPOINT, stream(ENDPOINT, call, outputs(call, ["x", "y"], reason=FinishReason.STOP)))
    unary = read_unary(ENDPOINT, ENDPOINT.render(call, completion(call, ["x", "y"], reason=FinishReason.STOP)))
    for answer in (streamed, unary):
        assert (answer.text, answer.finish_reason, answer.output_tokens) == ("xy", "stop", 2)
        assert answer.prompt_tokens == call.num_prompt_tokens
