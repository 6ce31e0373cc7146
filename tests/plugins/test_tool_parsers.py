"""The tool-call parsers: whole and incremental reading agree however the text is cut, the constraint they build,
the default prompt, and their registration as plugins."""

import json

import pytest

from pagoda.plugins.builtin.tool_parsers import HERMES, LLAMA3_JSON
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.manager import PluginError, collect_tool_parsers, describe_plugins, load_plugins
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.tools import Tool, ToolChoice, ToolParser, check_schema, plain_messages
from pagoda.plugins.turn import check_tools
from pagoda.plugins.tool_stream import ArgumentsDelta, CallEnded, CallStarted, ParsedCall, TextDelta, collect

WEATHER = Tool("get_weather", "the weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def streamed(parser, text, step):
    reader = parser.stream()
    events = []
    for i in range(0, len(text), step):
        events += reader.feed(text[i:i + step])
    return events + reader.finish()


HERMES_CASES = [
    ("plain text, no call", "Hello there.", "Hello there.", []),
    ("one call", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [ParsedCall("get_weather", '{"city": "Paris"}')]),
    ("text, two calls, text", 'Sure. <tool_call>{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>\n'
     '<tool_call>{"name":"b","arguments":{}}</tool_call> done', "Sure. done",
     [ParsedCall("a", '{"x": [1, {"y": "}"}]}'), ParsedCall("b", "{}")]),
    ("escaped quote and brace in a string", '<tool_call>{"name": "a", "arguments": {"q": "\\"}"}}</tool_call>', "",
     [ParsedCall("a", '{"q": "\\"}"}')]),
    ("a tag that is not a call is content", "a <tool_call> nonsense </tool_call> b",
     "a <tool_call> nonsense </tool_call> b", []),
    ("a partial tag at the end is content", "a <tool_c", "a <tool_c", []),
    ("a call cut off keeps what was written", '<tool_call>{"name": "a", "arguments": {"x": 1', "",
     [ParsedCall("a", '{"x": 1')]),
]


@pytest.mark.parametrize(("why", "text", "content", "calls"), HERMES_CASES, ids=[c[0] for c in HERMES_CASES])
def test_hermes_reads_the_same_whole_and_in_any_chunks(why, text, content, calls):
    parsed = HERMES.parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)
    for step in (1, 2, 3, 5, 11, len(text)):
        assert collect(streamed(HERMES, text, step)) == parsed, step


def test_llama3_json_reads_calls_at_the_start_only():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert LLAMA3_JSON.parse(text).calls == [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")]
    assert LLAMA3_JSON.parse('I think {"name": "a", "parameters": {}}').calls == []
    for step in (1, 4, 100):
        assert collect(streamed(LLAMA3_JSON, text, step)) == LLAMA3_JSON.parse(text)


def test_the_stream_gives_content_before_the_call_and_arguments_as_they_come():
    reader = HERMES.stream()
    assert reader.feed("Let me check. <tool") == [TextDelta("Let me check.")]  # the partial tag waits
    assert reader.feed('_call>{"name": "get_weather", ') == []
    assert reader.feed('"arguments": {"ci') == [CallStarted(0, "get_weather"), ArgumentsDelta(0, '{"ci')]
    assert reader.feed('ty": "Paris"}') == [ArgumentsDelta(0, 'ty": "Paris"}')]  # ends where the value closes
    assert reader.feed("}</tool_call>") == [CallEnded(0)]
    assert reader.finish() == []


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "get_weather"), ToolChoice("auto")])
def test_the_constraint_wraps_each_tool_schema_in_the_call_syntax(choice):
    other = Tool("noop")
    spec = json.loads(HERMES.constraint([WEATHER, other], choice).spec)
    assert spec["type"] == "structural_tag"
    fmt = spec["format"]
    if choice.mode == "auto":
        assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"] and not fmt["at_least_one"]
        tags = fmt["tags"]
    elif choice.mode == "named":
        tags = [fmt]
    else:
        assert fmt["type"] == "or"
        tags = fmt["elements"]
    names = ["get_weather"] if choice.mode == "named" else ["get_weather", "noop"]
    assert [t["begin"] for t in tags] == [f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in names]
    assert all(t["end"] == "}\n</tool_call>" for t in tags)
    assert tags[0]["content"] == {"type": "json_schema", "json_schema": WEATHER.schema}
    # what the constraint forces is what the parser reads back
    forced = tags[0]["begin"] + '{"city": "Oslo"}' + tags[0]["end"]
    assert HERMES.parse(forced).calls == [ParsedCall("get_weather", '{"city": "Oslo"}')]


def test_no_constraint_without_tools_or_with_choice_none():
    assert HERMES.constraint([WEATHER], ToolChoice("none")) is None
    assert HERMES.constraint([], ToolChoice("auto")) is None


def test_the_default_prompt_lists_the_tools_and_history_is_written_in_the_call_syntax():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plain = plain_messages(messages, [WEATHER], HERMES)
    assert plain[0]["role"] == "system" and plain[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER.as_openai()) in plain[0]["content"] and "<tool_call>" in plain[0]["content"]
    assert plain[2] == {"role": "assistant", "content": HERMES.call_text("get_weather", '{"city": "Paris"}')}
    assert plain[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert plain_messages(messages[1:2], [WEATHER], HERMES)[0]["role"] == "system"  # a system message is added


def test_schemas_and_tool_lists_are_checked():
    assert check_schema({"type": "object"}, "f") == {"type": "object"}
    with pytest.raises(RequestError) as info:
        check_schema({"type": "nonsense"}, "tools[0].function.parameters")
    assert info.value.param == "tools[0].function.parameters"
    with pytest.raises(RequestError) as info:
        check_tools([WEATHER], ToolChoice("named", "nope"), "tools", "tool_choice")
    assert info.value.param == "tool_choice"
    with pytest.raises(RequestError):
        check_tools([WEATHER, WEATHER], ToolChoice("auto"), "tools", "tool_choice")
    with pytest.raises(RequestError):
        check_tools([], ToolChoice("required"), "tools", "tool_choice")


class Bracket(ToolParser):
    name = "bracket"
    begin, end = "[[", "]]"


class BracketPlugin:
    @hookimpl
    def pagoda_register_tool_parsers(self, register):
        register(Bracket())


def test_parsers_are_plugins_collected_by_name():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    assert set(collect_tool_parsers(pm)) == {"hermes", "llama3_json"}
    builtin = next(i for i in describe_plugins(pm) if i.name == "tool_parsers")
    assert builtin.provides == ("tool parser 'hermes'", "tool parser 'llama3_json'")
    pm.register(BracketPlugin(), name="bracket")
    try:
        parser = collect_tool_parsers(pm)["bracket"]
        assert parser.parse('x [[{"name": "a", "arguments": {}}]]').calls == [ParsedCall("a", "{}")]
    finally:
        pm.unregister(name="bracket")


def test_two_parsers_with_one_name_are_an_error():
    class Twice:
        @hookimpl
        def pagoda_register_tool_parsers(self, register):
            register(Bracket())
            register(Bracket())

    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(Twice(), name="twice")
    with pytest.raises(PluginError, match="tool parsers"):
        collect_tool_parsers(pm)
