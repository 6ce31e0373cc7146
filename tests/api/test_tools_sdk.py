"""Tools and structured output end to end: the default model on a live server, through the official SDKs.

Forced calls and schemas are constrained, so even the 135M default model answers with arguments and objects
that validate against the schema; every answer here is checked with jsonschema or pydantic, not by eye.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from tests.server_fixtures import default_server  # noqa: F401  (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None or importlib.util.find_spec("pagoda.core.grammar")
                       is None, reason="constrained decoding (xgrammar, pagoda.core.grammar) is not installed"),
]

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                                "parameters": WEATHER_SCHEMA}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
MAX_TOKENS = 128


class City(BaseModel):
    # Bounded fields: a free integer lets a small model write digits until max_tokens, valid but endless.
    name: str
    country: Literal["France", "United Kingdom", "Japan"]
    capital: bool


def test_chat_parse_returns_the_pydantic_object(default_server):  # noqa: F811
    client = default_server.openai()
    reply = client.chat.completions.parse(
        model=default_server.model_name, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=MAX_TOKENS, temperature=0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City), reply
    assert reply.choices[0].finish_reason == "stop"


def test_chat_stream_with_a_required_tool_accumulates_a_valid_call(default_server):  # noqa: F811
    client = default_server.openai()
    with client.chat.completions.stream(model=default_server.model_name, messages=ASK, tools=CHAT_TOOLS,
                                        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_chat_two_turns_call_then_result_then_answer(default_server):  # noqa: F811
    client = default_server.openai()
    first = client.chat.completions.create(model=default_server.model_name, messages=ASK, tools=CHAT_TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=MAX_TOKENS, temperature=0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    second = client.chat.completions.create(model=default_server.model_name, messages=history, tools=CHAT_TOOLS,
                                            tool_choice="none", max_tokens=24, temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls
    default_server.assert_pool_whole()


def test_responses_parse_returns_the_pydantic_object(default_server):  # noqa: F811
    client = default_server.openai()
    response = client.responses.parse(model=default_server.model_name, input="Describe Paris as JSON.",
                                      text_format=City, max_output_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(response.output_parsed, City), response


def test_responses_stream_a_required_function_call(default_server):  # noqa: F811
    client = default_server.openai()
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
              "parameters": WEATHER_SCHEMA, "strict": True}]
    with client.responses.stream(model=default_server.model_name, input=ASK[0]["content"], tools=tools,
                                 tool_choice="required", max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert "".join(fragments) == calls[0].arguments
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    # the result goes back as a function_call_output item beside the call
    follow = client.responses.create(model=default_server.model_name, tools=tools, tool_choice="none",
                                     input=[{"role": "user", "content": ASK[0]["content"]}, calls[0].model_dump(),
                                            {"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "21 degrees, sunny"}],
                                     max_output_tokens=24, temperature=0)
    assert follow.output_text


def test_anthropic_stream_with_tool_choice_any_and_a_tool_result_turn(default_server):  # noqa: F811
    client = default_server.anthropic()
    tools = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA}]
    with client.messages.stream(model=default_server.model_name, max_tokens=MAX_TOKENS, messages=ASK, tools=tools,
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (tool_use,) = [block for block in final.content if block.type == "tool_use"]
    assert tool_use.id.startswith("toolu_") and tool_use.name == "get_weather"
    jsonschema.validate(tool_use.input, WEATHER_SCHEMA)
    follow = client.messages.create(
        model=default_server.model_name, max_tokens=24, tools=tools, extra_body={"temperature": 0},
        messages=[*ASK, {"role": "assistant", "content": [block.model_dump() for block in final.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                "content": "21 degrees, sunny"}]}])
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    default_server.assert_pool_whole()


def test_bad_tool_input_is_a_400_in_each_protocols_shape(default_server):  # noqa: F811
    import anthropic
    import openai

    client = default_server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=default_server.model_name, messages=ASK, tools=CHAT_TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(anthropic.BadRequestError) as info:
        default_server.anthropic().messages.create(
            model=default_server.model_name, max_tokens=4,
            messages=[*ASK, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}])
    assert "tool_use_id" in info.value.message
