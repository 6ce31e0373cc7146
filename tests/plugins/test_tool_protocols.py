"""Tools and structured output on the four protocols without a server: bodies -> Constraint and prompt,
tool calls rendered unary and streamed, history rendered into the prompt, bad tool input refused naming the field."""

import json

import pytest

from pagoda.core.constraint import Constraint
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.anthropic_messages import Messages
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.builtin.openai_responses import Responses
from pagoda.plugins.builtin.tool_parsers import HERMES
from pagoda.plugins.request_fields import RequestError
from tests.helpers import completion, context, outputs, prepared, stream

CHAT, RESPONSES, MESSAGES, COMPLETIONS = ChatCompletions(), Responses(), Messages(), Completions()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": SCHEMA}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": SCHEMA}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = HERMES.call_text("get_weather", '{"city": "Paris"}')
# the answer as the engine hands it over: a few pieces cut anywhere
PIECES = ["Let me look. ", CALL_TEXT[:15], CALL_TEXT[15:44], CALL_TEXT[44:50], CALL_TEXT[50:]]


def chat(**fields):
    return {"model": "m", "messages": USER, **fields}


def responses(**fields):
    return {"model": "m", "input": "Weather in Paris?", **fields}


def anthropic(**fields):
    return {"model": "m", "max_tokens": 64, "messages": USER, **fields}


# -- structured output -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("endpoint", "body", "expected"), [
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}),
     Constraint.json_schema(SCHEMA, "response_format.json_schema")),
    (CHAT, chat(response_format={"type": "json_object"}), Constraint("json_object", "", "response_format")),
    (CHAT, chat(response_format={"type": "text"}), None),
    (RESPONSES, responses(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}}),
     Constraint.json_schema(SCHEMA, "text.format")),
    (MESSAGES, anthropic(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}),
     Constraint.json_schema(SCHEMA, "output_config.format")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_json": SCHEMA}, Constraint.json_schema(SCHEMA, "guided_json")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_json": json.dumps(SCHEMA)},
     Constraint.json_schema(SCHEMA, "guided_json")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+", "guided_regex")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_choice": ["yes", "no"]},
     Constraint("choice", '["yes", "no"]', "guided_choice")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_grammar": 'root ::= "a"'},
     Constraint("grammar", 'root ::= "a"', "guided_grammar")),
    (COMPLETIONS, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}},
     Constraint("json_object", "", "response_format")),
])
def test_structured_output_fields_become_the_constraint(endpoint, body, expected):
    call = prepared(endpoint, body)
    assert call.request.sampling_params.constraint == expected
    assert call.request.tool_parser is None


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 3}}}),
     "response_format.json_schema.schema"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (RESPONSES, responses(text={"format": {"type": "json_schema", "name": "w"}}), "text.format.schema"),
    (MESSAGES, anthropic(output_config={"format": {"type": "json_schema", "schema": {"required": 1}}}),
     "output_config.format.schema"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_choice": []}, "guided_choice"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "guided_json": "{not json"}, "guided_json"),
])
def test_bad_structured_output_is_refused_naming_the_field(endpoint, body, param):
    with pytest.raises(RequestError) as info:
        prepared(endpoint, body)
    assert info.value.param == param


# -- tools in the request ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("endpoint", "body", "forced"), [
    (CHAT, chat(tools=CHAT_TOOLS, tool_choice="required"), True),
    (CHAT, chat(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), True),
    (CHAT, chat(tools=CHAT_TOOLS), False),
    (RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="required"), True),
    (RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"}), True),
    (RESPONSES, responses(tools=RESPONSES_TOOLS), False),
    (MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}), True),
    (MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"}), True),
    (MESSAGES, anthropic(tools=ANTHROPIC_TOOLS), False),
])
def test_tools_reach_the_prompt_and_the_constraint(endpoint, body, forced):
    ctx = context()
    call = prepared(endpoint, body, ctx)
    system = ctx.tokenizer.chats[0][0]
    assert system["role"] == "system" and system["content"].startswith("# Tools") and '"get_weather"' in system["content"]
    constraint = call.request.sampling_params.constraint
    assert constraint.kind == "structural_tag" and constraint.field == "tools"
    fmt = json.loads(constraint.spec)["format"]
    assert (fmt["type"] != "triggered_tags") == forced
    assert call.request.tool_parser is HERMES


@pytest.mark.parametrize(("endpoint", "body"), [
    (CHAT, chat(tools=CHAT_TOOLS, tool_choice="none")),
    (RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="none")),
    (MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})),
])
def test_tool_choice_none_is_plain_text(endpoint, body):
    ctx = context()
    call = prepared(endpoint, body, ctx)
    assert call.request.sampling_params.constraint is None and call.request.tool_parser is None
    assert "# Tools" not in json.dumps(ctx.tokenizer.chats)


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "nonsense"}}}


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]),
     "tools[0].function.parameters"),
    (CHAT, chat(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(tools=CHAT_TOOLS, response_format={"type": "json_object"}), "response_format"),
    (CHAT, chat(messages=[*USER, {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]),
     "messages[1].tool_call_id"),
    (CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (RESPONSES, responses(tools=[{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]), "tools[0].parameters"),
    (RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
    (RESPONSES, responses(input=[{"type": "function_call_output", "call_id": "call_x", "output": "sunny"}]),
     "input[0].call_id"),
    (MESSAGES, anthropic(tools=[{"name": "f", "input_schema": BAD_SCHEMA}]), "tools.0.input_schema"),
    (MESSAGES, anthropic(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
    (MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (MESSAGES, anthropic(messages=[*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "sunny"}]}]), "messages.2.content.0.tool_use_id"),
])
def test_bad_tool_input_is_refused_naming_the_field(endpoint, body, param):
    with pytest.raises(RequestError) as info:
        prepared(endpoint, body)
    assert info.value.param == param


def test_a_server_without_a_tool_parser_refuses_tools():
    with pytest.raises(RequestError) as info:
        prepared(CHAT, chat(tools=CHAT_TOOLS), context(tool_parser=None))
    assert info.value.param == "tools"


# -- history ---------------------------------------------------------------------------------------------

def expected_history(ctx):
    """What every protocol renders for: user asks, assistant calls get_weather, the tool answers 'sunny'."""
    system, user, assistant, result = ctx.tokenizer.chats[0]
    assert system["content"].startswith("# Tools") and user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant == {"role": "assistant", "content": CALL_TEXT}
    assert result == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_chat_history_with_calls_and_results_is_rendered():
    ctx = context()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    prepared(CHAT, chat(tools=CHAT_TOOLS, messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                                                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]), ctx)
    expected_history(ctx)


def test_responses_history_with_function_call_items_is_rendered():
    ctx = context()
    prepared(RESPONSES, responses(tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]), ctx)
    expected_history(ctx)


def test_anthropic_history_with_tool_use_and_tool_result_is_rendered():
    ctx = context()
    prepared(MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, messages=[
        *USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]), ctx)
    expected_history(ctx)


def test_a_template_that_takes_tools_gets_them_as_they_are():
    ctx = context()
    seen = {}

    def encode_chat(messages, add_generation_prompt=True, tools=None):
        seen.update(messages=messages, tools=tools)
        return [1]

    ctx.tokenizer.chat_template_takes_tools = True
    ctx.tokenizer.encode_chat = encode_chat
    prepared(CHAT, chat(tools=CHAT_TOOLS), ctx)
    assert seen["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                              "parameters": SCHEMA}}]
    assert seen["messages"] == USER


# -- rendering calls -------------------------------------------------------------------------------------

def test_chat_renders_tool_calls_unary_and_streamed_alike():
    call = prepared(CHAT, chat(tools=CHAT_TOOLS, tool_choice="required"))
    choice = CHAT.render(call, completion(call, PIECES, reason=FinishReason.STOP))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["id"].startswith("call_") and tool_call["type"] == "function"
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    deltas = [e.data["choices"][0]["delta"] for e in stream(CHAT, call, outputs(call, PIECES, reason=FinishReason.STOP))
              if e.data != "[DONE]" and e.data["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": tool_call["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    assert deltas[-1] == {}


def test_chat_without_a_call_is_text_with_finish_stop():
    call = prepared(CHAT, chat(tools=CHAT_TOOLS))
    choice = CHAT.render(call, completion(call, ["It is ", "sunny."], reason=FinishReason.STOP))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "It is sunny."
    assert "tool_calls" not in choice["message"]


def test_responses_renders_function_call_items_unary_and_streamed_alike():
    call = prepared(RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="required"))
    body = RESPONSES.render(call, completion(call, PIECES, reason=FinishReason.STOP))
    message, function_call = body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert function_call["type"] == "function_call" and function_call["call_id"].startswith("call_")
    assert (function_call["name"], function_call["arguments"], function_call["status"]) == (
        "get_weather", '{"city": "Paris"}', "completed")
    assert body["tools"][0]["name"] == "get_weather" and body["tool_choice"] == "required"

    events = [e.data for e in stream(RESPONSES, call, outputs(call, PIECES, reason=FinishReason.STOP))]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "message"), (1, "function_call")]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["name"] == "get_weather"
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(fragments) == done["arguments"] == '{"city": "Paris"}'
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["message", "function_call"]
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"] and final[1]["arguments"] == done["arguments"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_anthropic_renders_tool_use_blocks_unary_and_streamed_alike():
    call = prepared(MESSAGES, anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}))
    body = MESSAGES.render(call, completion(call, PIECES, reason=FinishReason.STOP))
    assert body["stop_reason"] == "tool_use"
    text, tool_use = body["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert tool_use["type"] == "tool_use" and tool_use["id"].startswith("toolu_")
    assert (tool_use["name"], tool_use["input"]) == ("get_weather", {"city": "Paris"})

    events = [e.data for e in stream(MESSAGES, call, outputs(call, PIECES, reason=FinishReason.STOP))]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "text"), (1, "tool_use")]
    assert starts[1]["content_block"]["input"] == {} and starts[1]["content_block"]["name"] == "get_weather"
    fragments = [e["delta"]["partial_json"] for e in events
                 if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    assert events[-1]["type"] == "message_stop"


# -- the client half -------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES, MESSAGES, COMPLETIONS], ids=lambda e: e.protocol)
def test_a_constrained_client_request_is_prepared_into_the_schema_constraint(endpoint):
    from pagoda.plugins.client import ClientRequest

    ask = ClientRequest("Paris?", 32, json_schema=SCHEMA, model="m")
    constraint = prepared(endpoint, endpoint.client_request(ask)).request.sampling_params.constraint
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == SCHEMA
    assert prepared(endpoint, endpoint.client_request(ClientRequest("Paris?", 32, model="m"))) \
        .request.sampling_params.constraint is None
