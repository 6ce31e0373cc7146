"""POST /v1/messages without a server: prepare, render, the named event stream, Anthropic's errors, the client half."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.anthropic_messages import ANTHROPIC_ERRORS, Messages
from pagoda.plugins.client import ClientError, ClientRequest
from pagoda.plugins.protocol import ApiError
from pagoda.plugins.request_fields import RequestError
from tests.helpers import completion, context, outputs, prepared, read_stream, read_unary, stream

ENDPOINT = Messages()
MESSAGES = [{"role": "user", "content": "hi"}]


def body(**fields):
    return {"model": "m", "max_tokens": 8, "messages": MESSAGES, **fields}


def test_system_blocks_and_messages_reach_the_template():
    ctx = context()
    system = [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "assistant", "content": "b"}]
    prepared(ENDPOINT, body(system=system, messages=messages), ctx)
    assert ctx.tokenizer.chats == [[{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}]]


def test_fields_map_to_sampling_params_with_sampling_params_defaults():
    p = prepared(ENDPOINT, body()).request.sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.ignore_eos) == (8, 1.0, 1.0, 0, (), False)
    p = prepared(ENDPOINT, body(temperature=0, top_p=0.5, top_k=4, stop_sequences=["\n"], seed=2,
                                ignore_eos=True)).request.sampling_params
    assert (p.greedy, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos) == (True, 0.5, 4, ("\n",), 2, True)


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": []}, "messages"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
    ({"system": [{"type": "document"}]}, "system.0"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(**fields))
    assert info.value.param == param and param in info.value.message


@pytest.mark.parametrize(("reason", "matched", "stop_reason", "sequence"), [
    (FinishReason.LENGTH, None, "max_tokens", None), (FinishReason.STOP, "\n", "stop_sequence", "\n"),
    (FinishReason.STOP, 2, "end_turn", None), (FinishReason.STOP, None, "end_turn", None),
])
def test_render_gives_the_stop_reason_and_usage(reason, matched, stop_reason, sequence):
    call = prepared(ENDPOINT, body())
    reply = ENDPOINT.render(call, completion(call, ["Hi", "!"], reason=reason, stop_reason=matched))
    assert reply["type"] == "message" and reply["role"] == "assistant" and reply["id"].startswith("msg_")
    assert reply["content"] == [{"type": "text", "text": "Hi!"}]
    assert (reply["stop_reason"], reply["stop_sequence"]) == (stop_reason, sequence)
    assert reply["usage"] == {"input_tokens": call.num_prompt_tokens, "output_tokens": 2,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_the_stream_is_anthropics_named_event_sequence():
    call = prepared(ENDPOINT, body(stream=True))
    events = stream(ENDPOINT, call, outputs(call, ["a", "b"], reason=FinishReason.STOP, stop_reason="\n"))
    assert [e.name for e in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(e.data["type"] == e.name for e in events)
    assert events[0].data["message"]["usage"] == {"input_tokens": call.num_prompt_tokens, "output_tokens": 0,
                                                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert [e.data["delta"]["text"] for e in events[3:5]] == ["a", "b"]
    assert events[6].data == {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "\n"},
                              "usage": {"input_tokens": call.num_prompt_tokens, "output_tokens": 2,
                                        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
    (529, "overloaded_error"), (418, "invalid_request_error"),
])
def test_every_status_has_its_anthropic_type(status, kind):
    assert ENDPOINT.errors is ANTHROPIC_ERRORS
    body = ANTHROPIC_ERRORS.render_error(ApiError(status, "why", "field"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert ANTHROPIC_ERRORS.read_error(status, body) == ApiError(status, "why")


def test_a_stream_error_is_an_error_event_the_client_half_raises_on():
    call = prepared(ENDPOINT, body(stream=True))
    [event] = ENDPOINT.render_stream_error(call, ApiError(500, "device lost"))
    assert event.name == "error" and event.data["error"]["type"] == "api_error"
    with pytest.raises(ClientError, match="device lost"):
        ENDPOINT.client_answer().event(event.data)


def test_the_client_half_asks_what_the_server_half_prepares_and_reads_what_it_renders():
    ask = ClientRequest("abc", 3, stream=True, temperature=0.9, top_k=7, seed=5, ignore_eos=True, model="m")
    call = prepared(ENDPOINT, ENDPOINT.client_request(ask))
    p = call.request.sampling_params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.ignore_eos) == (3, 0.9, 7, 5, True)
    for reason, finish in ((FinishReason.LENGTH, "length"), (FinishReason.STOP, "stop")):
        outs = outputs(call, ["x", "y", "z"], reason=reason)
        streamed = read_stream(ENDPOINT, stream(ENDPOINT, call, outs))
        unary = read_unary(ENDPOINT, ENDPOINT.render(call, completion(call, ["x", "y", "z"], reason=reason)))
        for answer in (streamed, unary):
            assert (answer.text, answer.finish_reason, answer.output_tokens) == ("xyz", finish, 3)
            assert answer.prompt_tokens == call.num_prompt_tokens
