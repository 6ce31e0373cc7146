"""The client half, for every registered endpoint (the built-in ones and installed plugins'): its request is one
its server half prepares, and its answer reader reads what its server half renders, unary and streamed."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.client import ClientRequest, line_data
from pagoda.plugins.manager import endpoints_by_protocol, registered_endpoints
from pagoda.plugins.manager import load_plugins
from pagoda.plugins.protocol import ApiError
from tests.helpers import completion, context, outputs, prepared, read_stream, read_unary, stream

ENDPOINTS = registered_endpoints(load_plugins({}))  # PAGODA_PLUGINS unset: every installed plugin too


def test_the_built_in_protocols_keep_their_crowd_names():
    assert {"completions", "chat", "responses", "messages"} <= set(ENDPOINTS)


def test_two_endpoints_with_one_protocol_name_are_refused():
    chat = ENDPOINTS["chat"]
    with pytest.raises(ValueError, match="share the protocol name 'chat'"):
        endpoints_by_protocol([chat, chat])


@pytest.mark.parametrize("protocol", list(ENDPOINTS))
@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "stream"])
def test_each_endpoints_client_half_matches_its_server_half(protocol, streamed):
    endpoint = ENDPOINTS[protocol]
    ask = ClientRequest("abc", 3, stream=streamed, temperature=0.5, top_p=0.9, top_k=5, seed=11, ignore_eos=True,
                        model="m")
    ctx = context()
    call = prepared(endpoint, endpoint.client_request(ask), ctx)
    p = call.request.sampling_params
    assert call.request.stream is streamed
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos) == (3, 0.5, 0.9, 5, 11, True)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)  # no one's defaults
    assert "abc" in ctx.tokenizer.decode(call.request.prompt_token_ids)
    for reason, finish in ((FinishReason.LENGTH, "length"), (FinishReason.STOP, "stop")):
        if streamed:
            answer = read_stream(endpoint, stream(endpoint, call, outputs(call, ["x", "y", "z"], reason=reason)))
        else:
            answer = read_unary(endpoint, endpoint.render(call, completion(call, ["x", "y", "z"], reason=reason)))
        assert (answer.text, answer.finish_reason, answer.output_tokens) == ("xyz", finish, 3)
        assert answer.prompt_tokens == call.num_prompt_tokens


@pytest.mark.parametrize("protocol", list(ENDPOINTS))
def test_each_error_shape_reads_back_what_it_renders(protocol):
    shape = ENDPOINTS[protocol].errors
    for status in (400, 401, 404, 500):
        body = shape.render_error(ApiError(status, "why"))
        error = shape.read_error(status, body)
        assert error.message == "why" and shape.render_error(error) == body


def test_line_data_reads_sse_and_ndjson_lines():
    assert line_data("sse", 'data: {"a": 1}') == {"a": 1}
    assert line_data("sse", "data: [DONE]") == "[DONE]"
    for other in ("event: ping", ": keep-alive", ""):
        assert line_data("sse", other) is None
    assert line_data("ndjson", '{"done": true}') == {"done": True}
    assert line_data("ndjson", "") is None


def test_sampling_fields_leave_out_what_is_off():
    assert ClientRequest("x", 1, model="m").sampling_fields() == {"model": "m", "stream": False, "temperature": 0.0,
                                                                  "top_p": 1.0}
