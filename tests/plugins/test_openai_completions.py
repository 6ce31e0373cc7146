"""POST /v1/completions without a server: prepare, render, render_stream, errors and the client half."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.request_fields import RequestError
from tests.helpers import completion, context, outputs, prepared, read_stream, read_unary, stream

ENDPOINT = Completions()


def body(**fields):
    return {"model": "m", "prompt": "abc", **fields}


def test_a_text_prompt_is_encoded_and_token_ids_are_taken_as_they_are():
    assert prepared(ENDPOINT, body()).request.prompt_token_ids == [97, 98, 99]
    assert prepared(ENDPOINT, body(prompt=[5, 6])).request.prompt_token_ids == [5, 6]
    assert prepared(ENDPOINT, body(prompt=["ab"])).request.prompt_token_ids == [97, 98]  # a batch of one


def test_fields_map_to_sampling_params():
    call = prepared(ENDPOINT, body(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                                   stop=["x"], presence_penalty=0.5, frequency_penalty=-0.5,
                                   repetition_penalty=1.2, ignore_eos=True, logprobs=2, stream=True))
    p = call.request.sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (7, 0.5, 0.9, 5, 0.1, 3, ("x",))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.ignore_eos, p.logprobs) == \
        (0.5, -0.5, 1.2, True, 2)
    assert call.request.stream


def test_no_max_tokens_is_what_fits():
    call = prepared(ENDPOINT, body(), context(max_model_len=100, max_kv_tokens=1000))
    assert call.request.sampling_params.max_tokens == 97  # 100 - 3 prompt tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": [[1], "a", 3]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], "a"]}, "prompt"), ({"prompt": ["a", [1, 2]]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
    ({"n": 129}, "n"), ({"prompt": ["a"] * 65, "n": 2}, "n"), ({"n": 2, "seed": 2**64 - 1}, "seed"),
    ({"stop": [""]}, "stop"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(**fields))
    assert info.value.param == param and info.value.status == 400


def test_render_gives_text_finish_reason_and_usage():
    call = prepared(ENDPOINT, body(max_tokens=2))
    reply = ENDPOINT.render(call, completion(call, ["Hel", "lo"]))
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-") and reply["model"] == "m"
    assert reply["choices"] == [{"index": 0, "text": "Hello", "finish_reason": "length", "logprobs": None}]
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    stopped = ENDPOINT.render(call, completion(call, ["x"], reason=FinishReason.STOP, stop_reason="\n"))
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_echo_puts_the_prompt_before_the_text_and_logprobs_have_offsets():
    call = prepared(ENDPOINT, body(echo=True))
    assert ENDPOINT.render(call, completion(call, ["d"]))["choices"][0]["text"] == "abcd"
    call = prepared(ENDPOINT, body(logprobs=1))
    logprobs = ENDPOINT.render(call, completion(call, ["d", "e"], logprobs=True))["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["d", "e"] and logprobs["text_offset"] == [0, 1]
    assert logprobs["token_logprobs"] == [-0.5, -0.5] and logprobs["top_logprobs"][0] == {"d": -0.5, "B": -1.5}


def test_the_stream_is_chunks_then_usage_then_done():
    call = prepared(ENDPOINT, body(stream=True, stream_options={"include_usage": True}))
    events = stream(ENDPOINT, call, outputs(call, ["a", "b"]))
    assert [e.data["choices"] for e in events[:2]] == [
        [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "b", "finish_reason": "length", "logprobs": None}]]
    assert events[2].data["choices"] == [] and events[2].data["usage"]["completion_tokens"] == 2
    assert events[3].data == "[DONE]" and len(events) == 4
    assert len({e.data["id"] for e in events[:3]}) == 1


def test_without_include_usage_there_is_no_usage_chunk():
    call = prepared(ENDPOINT, body(stream=True))
    events = stream(ENDPOINT, call, outputs(call, ["a"]))
    assert [e.data for e in events][-1] == "[DONE]" and len(events) == 2 and "usage" not in events[0].data


def test_the_client_half_asks_what_the_server_half_prepares():
    ask = ClientRequest("abc", 6, stream=True, temperature=0.7, top_p=0.8, top_k=4, seed=9, model="m")
    call = prepared(ENDPOINT, ENDPOINT.client_request(ask))
    p = call.request.sampling_params
    assert call.request.prompt_token_ids == [97, 98, 99] and call.request.stream
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos) == (6, 0.7, 0.8, 4, 9, False)
    assert call.body.include_usage


def test_the_client_half_reads_what_the_server_half_renders():
    ask = ClientRequest("abc", 2, stream=True)
    call = prepared(ENDPOINT, ENDPOINT.client_request(ask))
    streamed = read_stream(ENDPOINT, stream(ENDPOINT, call, outputs(call, ["Hel", "lo"])))
    unary = read_unary(ENDPOINT, ENDPOINT.render(call, completion(call, ["Hel", "lo"])))
    for answer in (streamed, unary):
        assert (answer.text, answer.finish_reason, answer.prompt_tokens, answer.output_tokens) == ("Hello", "length", 3, 2)


def test_echo_with_logprobs_and_prompt_logprobs_ask_the_engine_to_score_the_prompt():
    def scored(**fields):
        return prepared(ENDPOINT, body(**fields)).request.sampling_params.prompt_logprobs

    assert scored() is None and scored(echo=True) is None and scored(logprobs=3) is None
    assert scored(echo=True, logprobs=3) == 3 and scored(prompt_logprobs=0) == 0
    assert scored(echo=True, logprobs=1, prompt_logprobs=4) == 4  # one list at each position serves both
    assert prepared(ENDPOINT, body(echo=True, logprobs=1, max_tokens=0)).request.sampling_params.max_tokens == 0


def test_max_logprobs_bounds_prompt_logprobs():
    import dataclasses

    from pagoda.plugins.request_fields import RequestLimits

    strict = dataclasses.replace(context(), limits=RequestLimits(max_logprobs=2))
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(prompt_logprobs=3), strict)
    assert info.value.param == "prompt_logprobs" and "at most 2" in info.value.message
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(echo=True, logprobs=3), strict)
    assert info.value.param == "logprobs"
