"""What the three OpenAI endpoints share: the error shape, sampling fields, roles, usage, the client half's parts."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.builtin.openai_responses import Responses
from pagoda.plugins.client import ClientError, ClientRequest
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.protocol import ApiError
from pagoda.plugins.request_fields import RequestError
from tests.helpers import context, decode, outputs, prepared

ENDPOINTS = (Completions(), ChatCompletions(), Responses())


def test_the_three_endpoints_share_one_error_shape():
    assert all(e.errors is OPENAI_ERRORS for e in ENDPOINTS)


@pytest.mark.parametrize(("status", "kind", "code"), [
    (400, "invalid_request_error", None), (401, "invalid_request_error", "invalid_api_key"),
    (403, "permission_error", None), (404, "invalid_request_error", "not_found"),
    (413, "invalid_request_error", "request_too_large"), (415, "invalid_request_error", None),
    (422, "invalid_request_error", None), (429, "rate_limit_error", "rate_limit_exceeded"),
    (431, "invalid_request_error", None), (418, "invalid_request_error", None),
    (500, "server_error", None), (503, "server_error", None),
])
def test_every_status_has_its_openai_type(status, kind, code):
    body = OPENAI_ERRORS.render_error(ApiError(status, "why", "field"))
    assert body == {"error": {"message": "why", "type": kind, "param": "field", "code": code}}


def test_an_errors_own_code_wins_and_a_body_reads_back():
    error = ApiError(400, "too long", "max_tokens", "context_length_exceeded")
    body = OPENAI_ERRORS.render_error(error)
    assert body["error"]["code"] == "context_length_exceeded"
    assert OPENAI_ERRORS.read_error(400, body) == error


def test_a_stream_error_is_one_unnamed_data_event():
    [event] = OPENAI_ERRORS.render_stream_error(ApiError(500, "device lost"))
    assert event.name is None and event.data["error"]["type"] == "server_error"


def test_sampling_defaults_are_sampling_params_own():
    call = prepared(ChatCompletions(), {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    params = call.request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (1.0, 1.0, 0, ())


def test_vllms_top_k_minus_one_is_off_and_a_single_stop_string_is_a_tuple():
    body = {"model": "m", "prompt": "x", "top_k": -1, "stop": "\n", "temperature": 0}
    params = prepared(Completions(), body).request.sampling_params
    assert params.top_k == 0 and params.stop == ("\n",) and params.greedy


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.protocol)
def test_an_empty_stop_string_is_refused_naming_stop(endpoint):
    body = {"model": "m", "stop": ["ok", ""], **endpoint.client_request(ClientRequest("hi", 4))}
    with pytest.raises(RequestError, match="stop must be non-empty") as info:
        prepared(endpoint, body)
    assert info.value.param == "stop"


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.protocol)
def test_stop_strings_are_bounded_by_the_configured_limits(endpoint):
    import dataclasses

    from pagoda.plugins.request_fields import RequestLimits

    many = {"stop": [str(i) for i in range(17)], **endpoint.client_request(ClientRequest("hi", 4))}
    with pytest.raises(RequestError, match="at most 16 strings") as info:
        prepared(endpoint, many)
    assert info.value.param == "stop"
    with pytest.raises(RequestError, match="at most 1000 characters"):
        prepared(endpoint, {**many, "stop": ["x" * 100_000]})
    roomy = dataclasses.replace(context(), limits=RequestLimits(max_stop=32))
    assert len(prepared(endpoint, many, roomy).request.sampling_params.stop) == 17


def test_n_and_logit_bias_are_checked_once():
    with pytest.raises(RequestError) as info:
        prepared(Completions(), {"model": "m", "prompt": "x", "n": 129})
    assert info.value.param == "n"
    with pytest.raises(RequestError) as info:
        prepared(Completions(), {"model": "m", "prompt": "x", "logit_bias": {"a": 1}})
    assert info.value.param == "logit_bias"
    params = prepared(Completions(), {"model": "m", "prompt": "x", "logit_bias": {"7": -100}}).request.sampling_params
    assert params.logit_bias == {7: -100.0}


def test_the_developer_role_is_the_templates_system():
    assert oc.template_message("developer", "be brief") == {"role": "system", "content": "be brief"}
    assert oc.template_message("user", "hi") == {"role": "user", "content": "hi"}


def test_usage_finish_reasons_and_the_usage_chunk():
    assert oc.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert oc.usage(3, 4, 2)["prompt_tokens_details"] == {"cached_tokens": 2}
    assert [oc.finish_reason(r) for r in FinishReason] == ["stop", "length", "stop", "stop"]
    call = prepared(Completions(), {"model": "m", "prompt": "abc"})
    last = outputs(call, ["x", "y"])[-1]
    chunk = oc.usage_chunk({"id": "c", "choices": [{"index": 0}], "usage": None}, last)
    assert chunk == {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}}


def test_client_fields_ask_a_stream_for_its_usage():
    ask = ClientRequest("hi", 5, stream=True, top_k=40, seed=3, ignore_eos=True, model="m")
    assert oc.client_fields(ask) == {"model": "m", "stream": True, "temperature": 0.0, "top_p": 1.0, "top_k": 40,
                                     "seed": 3, "ignore_eos": True, "max_tokens": 5,
                                     "stream_options": {"include_usage": True}}
    assert "stream_options" not in oc.client_fields(ClientRequest("hi", 5))
    assert "top_k" not in oc.client_fields(ClientRequest("hi", 5))  # 0 = off: left to the server's default


def test_a_choices_answer_raises_on_an_error_event_and_skips_done():
    answer = Completions().client_answer()
    answer.event("[DONE]")
    with pytest.raises(ClientError, match="device lost"):
        answer.event(OPENAI_ERRORS.render_error(ApiError(500, "device lost")))
