"""POST /v1/responses without a server: prepare, render, the typed event stream, errors and the client half."""

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.openai_responses import Responses
from pagoda.plugins.client import ClientError, ClientRequest
from pagoda.plugins.protocol import ApiError
from pagoda.plugins.request_fields import RequestError
from tests.helpers import completion, context, outputs, prepared, read_stream, read_unary, stream

ENDPOINT = Responses()


def body(**fields):
    return {"model": "m", "input": "hi", **fields}


def test_instructions_are_the_system_message_and_items_keep_their_roles():
    ctx = context()
    items = [{"role": "developer", "content": "no"}, {"role": "user",
              "content": [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]}]
    prepared(ENDPOINT, body(input=items, instructions="be brief"), ctx)
    prepared(ENDPOINT, body(), ctx)
    assert ctx.tokenizer.chats == [
        [{"role": "system", "content": "be brief"}, {"role": "system", "content": "no"},
         {"role": "user", "content": "a\nb"}],
        [{"role": "user", "content": "hi"}]]


def test_fields_map_to_sampling_params():
    call = prepared(ENDPOINT, body(max_output_tokens=5, temperature=0, top_logprobs=2, stop="\n", seed=4, top_k=-1,
                                   ignore_eos=True))
    p = call.request.sampling_params
    assert (p.max_tokens, p.greedy, p.logprobs, p.stop, p.seed, p.top_k, p.ignore_eos) == \
        (5, True, 2, ("\n",), 4, 0, True)
    p = prepared(ENDPOINT, body()).request.sampling_params
    assert (p.temperature, p.top_p, p.logprobs) == (1.0, 1.0, None)


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"stop": ["a", ""]}, "stop"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        prepared(ENDPOINT, body(**fields))
    assert info.value.param == param


def test_render_is_a_completed_or_incomplete_response():
    call = prepared(ENDPOINT, body(max_output_tokens=2, metadata={"k": "v"}))
    done = ENDPOINT.render(call, completion(call, ["a"], reason=FinishReason.STOP))
    assert done["object"] == "response" and done["id"].startswith("resp_") and done["status"] == "completed"
    assert done["incomplete_details"] is None and done["metadata"] == {"k": "v"}
    [message] = done["output"]
    assert message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "a", "annotations": [], "logprobs": []}]
    assert done["usage"]["input_tokens"] == call.num_prompt_tokens and done["usage"]["output_tokens"] == 1
    cut = ENDPOINT.render(call, completion(call, ["a", "b"]))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_stream_is_the_sdks_event_sequence_numbered_from_zero():
    call = prepared(ENDPOINT, body(stream=True))
    events = stream(ENDPOINT, call, outputs(call, ["a", "b"]))
    assert [e.name for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.data["sequence_number"] for e in events] == list(range(10))
    assert all(e.data["type"] == e.name for e in events)
    assert events[6].data["text"] == "ab" and events[-1].data["response"]["status"] == "incomplete"
    item_ids = {e.data["item_id"] for e in events if "item_id" in e.data}
    assert item_ids == {events[-1].data["response"]["output"][0]["id"]}


def test_a_stream_error_continues_the_numbering_with_openais_error():
    call = prepared(ENDPOINT, body(stream=True))
    stream(ENDPOINT, call, outputs(call, ["a"]))
    [event] = ENDPOINT.render_stream_error(call, ApiError(500, "device lost"))
    assert event.name == "error" and event.data["sequence_number"] == 9  # after 9 events
    assert event.data["message"] == "device lost" and event.data["error"]["type"] == "server_error"
    with pytest.raises(ClientError, match="device lost"):
        ENDPOINT.client_answer().event(event.data)


def test_the_client_half_asks_what_the_server_half_prepares_and_reads_what_it_renders():
    ask = ClientRequest("abc", 2, stream=True, top_p=0.5, top_k=3, model="m")
    call = prepared(ENDPOINT, ENDPOINT.client_request(ask))
    p = call.request.sampling_params
    assert (p.max_tokens, p.top_p, p.top_k, p.greedy) == (2, 0.5, 3, True)
    streamed = read_stream(ENDPOINT, stream(ENDPOINT, call, outputs(call, ["x", "y"])))
    unary = read_unary(ENDPOINT, ENDPOINT.render(call, completion(call, ["x", "y"])))
    for answer in (streamed, unary):
        assert (answer.text, answer.finish_reason, answer.output_tokens) == ("xy", "length", 2)
        assert answer.prompt_tokens == call.num_prompt_tokens
