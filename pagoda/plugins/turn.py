"""A turn: what one request asks, in no protocol's words, and the one way it becomes an `EngineRequest`.

A protocol's `prepare` reads its wire body once, in its own module, into a `Turn` (the conversation as the chat
template reads it, or a plain prompt; the tools and the choice; the output constraint; the sampling fields), then
hands it to `engine_request`, which does what every protocol does alike:

    check    the choice against the tools; an output format and tools together are refused (a call's arguments
             follow its schema already); a tool without a server tool parser is refused
    render   the prompt: the chat template (tools listed, or the parser's default prompt) or the plain prompt
    build    SamplingParams within the server's limits (the tools' constraint, or the output format's) and the
             EngineRequest, with the parser that reads the answer's calls

Errors name the protocol's own fields: the turn carries those names (`choice_field`, `format_field`, `renames`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.core.constraint import Constraint
from pagoda.plugins.protocol import EngineRequest, ServeContext
from pagoda.plugins.request_fields import RequestError, make_sampling_params
from pagoda.plugins.tools import Tool, ToolChoice, ToolParser, require_parser


@dataclass(frozen=True)
class Turn:
    """One request decoded: a conversation (`messages`) or a plain `prompt`, and what to do with it."""

    messages: Sequence[Mapping[str, Any]] | None = None  # role, content, tool_calls, tool_call_id: template-ready
    prompt: str | Sequence[int] | None = None  # a plain prompt, text or token ids (when there are no messages)
    tools: Sequence[Tool] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    constraint: Constraint | None = None  # the output format asked (response_format, text.format, guided_*, ...)
    max_tokens: int | None = None  # None = as many as fit
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams' other keywords; None = its default
    n: int = 1
    stream: bool = False
    cache_salt: str | None = None
    priority: int | None = None
    # The protocol's names, for the errors engine_request raises:
    choice_field: str = "tool_choice"  # the choice (or the name a named choice gives)
    format_field: str = "response_format"  # the output format
    renames: Mapping[str, str] = field(default_factory=dict)  # SamplingParams' name -> the protocol's

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a turn holds messages or a prompt, not both and not neither")


def engine_request(turn: Turn, ctx: ServeContext) -> EngineRequest:
    """The turn checked, its prompt rendered and its sampling params built: what the engine is asked."""
    check_tools(turn.tools, turn.tool_choice, "tools", turn.choice_field)
    constraint, parser, listed = tool_use(ctx.tool_parser, turn.tools, turn.tool_choice, turn.constraint,
                                          turn.format_field)
    ids = prompt_ids(turn, listed, ctx)
    params = make_sampling_params(
        turn.renames,
        limits=ctx.limits,
        max_tokens=ctx.default_max_tokens(len(ids)) if turn.max_tokens is None else turn.max_tokens,
        constraint=constraint,
        **turn.sampling,
    )
    return EngineRequest(ids, params, stream=turn.stream, cache_salt=turn.cache_salt, tool_parser=parser,
                         n=turn.n, priority=turn.priority)


def prompt_ids(turn: Turn, tools: Sequence[Tool], ctx: ServeContext) -> list[int]:
    """The turn's prompt as token ids: its messages through the chat template (listing `tools`), or its prompt."""
    if turn.messages is not None:
        return ctx.encode_chat(turn.messages, tools)
    if isinstance(turn.prompt, str):
        return ctx.encode(turn.prompt)
    return list(turn.prompt)


def check_tools(tools: Sequence[Tool], choice: ToolChoice, field: str, choice_field: str) -> None:
    """Names are unique and a named choice names one of them."""
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if not name or names.index(name) != i:
            raise RequestError(f"{field}[{i}]: tool names must be non-empty and unique, got {name!r}", field)
    if choice.mode == "named" and choice.name not in names:
        raise RequestError(f"{choice_field} names {choice.name!r}, which is not in {field}", choice_field)
    if choice.forced and not tools:
        raise RequestError(f"{choice_field} {choice.mode!r} needs at least one tool in {field}", choice_field)


def tool_use(parser: ToolParser | None, tools: Sequence[Tool], choice: ToolChoice, constraint: Constraint | None,
             format_field: str) -> tuple[Constraint | None, ToolParser | None, list[Tool]]:
    """What a request's tools ask of the engine, given the server's parser: (the constraint, the parser that reads
    the answer, the tools the prompt lists). No tools, or choice none: the output format's constraint alone, plain
    text."""
    if choice.mode == "none" or not tools:
        return constraint, None, []
    if constraint is not None:
        raise RequestError(f"{format_field} cannot be combined with tools: a call's arguments already follow its"
                           " schema", format_field)
    parser = require_parser(parser)
    return parser.constraint(tools, choice), parser, list(tools)
