"""The way a body takes through `prepare`, measured: the protocol's module reads it into a Turn, one shared function
checks the turn and builds the EngineRequest, and neither hands it back to the other."""

import sys
from pathlib import Path

import pytest

import pagoda
from pagoda.core.constraint import Constraint
from pagoda.plugins.builtin.anthropic_messages import Messages
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.builtin.openai_responses import Responses
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.tools import Tool, ToolChoice
from pagoda.plugins.turn import Turn, engine_request
from tests.helpers import context, decode

PACKAGE = str(Path(pagoda.__file__).parent) + "/"
TURN = "plugins/turn.py"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# A body of each protocol with tools, a past call and its result (completions: guided_json over two prompts).
BODIES = {
    "chat": (ChatCompletions(), {
        "model": "m", "temperature": 0.5, "tool_choice": "auto",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": SCHEMA}}]}),
    "responses": (Responses(), {
        "model": "m", "instructions": "Be brief.", "tool_choice": "required",
        "input": [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "tools": [{"type": "function", "name": "get_weather", "description": "w", "parameters": SCHEMA}]}),
    "messages": (Messages(), {
        "model": "m", "max_tokens": 64, "system": "Be brief.", "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        "tools": [{"name": "get_weather", "description": "w", "input_schema": SCHEMA}]}),
    "completions": (Completions(), {"model": "m", "prompt": ["Paris:", "Rome:"], "guided_json": SCHEMA,
                                    "temperature": 0.5}),
}
COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")


def module_of(frame) -> str | None:
    name = frame.f_code.co_filename
    return name[len(PACKAGE):] if name.startswith(PACKAGE) else None


def hand_offs(endpoint, body) -> list[tuple[str | None, set[tuple[str, str]]]]:
    """`prepare`'s own module, then the module of each call it makes, in order, each with the pagoda functions
    (module, name) entered below it (what a module does with what it was handed is its own business)."""
    struct, ctx = decode(endpoint, body), context()
    stays: list[tuple[str | None, set[tuple[str, str]]]] = []
    root = []

    def caller(frame):
        frame = frame.f_back
        while frame is not None and frame.f_code.co_name in COMPREHENSIONS:  # a comprehension is its function's
            frame = frame.f_back
        return frame

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name in COMPREHENSIONS:
            return
        if not root:
            root.append(frame)
            stays.append((module_of(frame), set()))
        elif caller(frame) is root[0]:
            stays.append((module_of(frame), set()))
        elif module_of(frame) is not None:
            stays[-1][1].add((module_of(frame), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        endpoint.prepare(struct, ctx)
    finally:
        sys.setprofile(None)
    return [(module, below) for module, below in stays if module is not None]


@pytest.mark.parametrize("protocol", BODIES)
def test_a_body_goes_once_through_its_protocol_then_the_turn(protocol):
    stays = hand_offs(*BODIES[protocol])
    path = [module for i, (module, _) in enumerate(stays) if i == 0 or stays[i - 1][0] != module]
    assert len(set(path)) <= 3, path
    assert len(path) == len(set(path)), f"a module is entered again after it was left: {path}"
    assert path[-1] == TURN, path
    read = set().union(*(below for module, below in stays if module != TURN))
    early = {f for f in read if f[0] == "plugins/protocol.py" or f[0] == TURN and f[1] != "__post_init__"}
    assert not early, f"the body is read whole before the turn goes on: {sorted(early)}"
    climbed = {module for module, _ in stays[-1][1]} & set(path[:-1])
    assert not climbed, f"the turn climbs back into {sorted(climbed)}"


def test_a_turn_of_token_ids_becomes_the_request_as_it_is():
    request = engine_request(Turn(prompt=[5, 6, 7], max_tokens=0, sampling={"prompt_logprobs": 2}), context())
    assert request.prompt_token_ids == [5, 6, 7]
    assert (request.sampling_params.max_tokens, request.sampling_params.prompt_logprobs) == (0, 2)
    assert request.tool_parser is None


def test_a_turn_names_the_protocols_fields_in_its_errors():
    weather = Tool("get_weather", parameters=SCHEMA)
    with pytest.raises(RequestError) as bad:
        engine_request(Turn(messages=[{"role": "user", "content": "x"}], tools=[weather],
                            tool_choice=ToolChoice("named", "nope"), choice_field="tool_choice.name"), context())
    assert bad.value.param == "tool_choice.name"
    with pytest.raises(RequestError) as bad:
        engine_request(Turn(messages=[{"role": "user", "content": "x"}], tools=[weather], tool_choice=ToolChoice(),
                            constraint=Constraint("json_object", "", "text.format"), format_field="text.format"),
                       context())
    assert bad.value.param == "text.format"
    with pytest.raises(RequestError) as bad:
        engine_request(Turn(prompt="x", sampling={"stop": [""]}, renames={"stop": "stop_sequences"}), context())
    assert bad.value.param == "stop_sequences"


def test_a_turn_holds_messages_or_a_prompt():
    with pytest.raises(ValueError):
        Turn()
    with pytest.raises(ValueError):
        Turn(messages=[], prompt="x")
