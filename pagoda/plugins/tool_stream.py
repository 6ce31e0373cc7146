"""Tool calls read out of an answer: the events, the incremental reader that makes them, and `collect`.

An answer read for tool calls is a sequence of events, the same whether it is read whole or as it streams:

    TextDelta(text)              content outside any call
    CallStarted(index, name)     call number `index` begins (its name is known)
    ArgumentsDelta(index, text)  a fragment of its arguments' JSON text, as the model wrote it
    CallEnded(index)             it is complete

`ToolEvents` is the one dispatch over them: a subclass says what each event becomes (a protocol's stream
deltas, its content blocks, the whole answer's content and calls in `collect`).

`CallStream` reads the events out of the text. It keeps the whole text and a position, and moves through
four states:

    text    content; a partial BEGIN at the end is held back until it is decided
    header  after BEGIN: waits for `{"name": "...", "<key>": ` and then starts the call
    args    the arguments' JSON, passed on as it comes; a small scanner (strings, escapes, depth) finds where
            the value closes, so no fragment ever goes past it
    close   after the arguments: the wrapper's `}` and END (or, with no END, a `;` and the next call)

A syntax with no BEGIN (Llama-3's JSON calls) reads calls only at the start of the answer: if the answer does
not begin with `{`, it is all content. Anything that turns out not to be a call is given back as content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

PYTHON_TAG = "<|python_tag|>"  # Llama-3's marker before a call; skipped
T = TypeVar("T")


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnded:
    index: int


ToolEvent = TextDelta | CallStarted | ArgumentsDelta | CallEnded


class ToolEvents(Generic[T]):
    """What a sequence of tool events becomes: a subclass maps each kind of event to its items."""

    def handle(self, events: Sequence[ToolEvent]) -> list[T]:
        """The items of these events, in order."""
        items: list[T] = []
        for event in events:
            match event:
                case TextDelta(text=text):
                    items += self.text(text)
                case CallStarted(index=index, name=name):
                    items += self.call_started(index, name)
                case ArgumentsDelta(index=index, text=text):
                    items += self.arguments(index, text)
                case CallEnded(index=index):
                    items += self.call_ended(index)
        return items

    def text(self, text: str) -> list[T]:
        """Content outside any call."""
        return []

    def call_started(self, index: int, name: str) -> list[T]:
        """Call number `index`, named `name`, begins."""
        return []

    def arguments(self, index: int, text: str) -> list[T]:
        """A fragment of call `index`'s arguments (JSON text)."""
        return []

    def call_ended(self, index: int) -> list[T]:
        """Call `index` is complete."""
        return []


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the JSON text the model wrote


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall]


class _Collected(ToolEvents[None]):
    def __init__(self) -> None:
        self.content: list[str] = []
        self.names: list[str] = []
        self.arguments_of: list[list[str]] = []

    def text(self, text: str) -> list[None]:
        self.content.append(text)
        return []

    def call_started(self, index: int, name: str) -> list[None]:
        self.names.append(name)
        self.arguments_of.append([])
        return []

    def arguments(self, index: int, text: str) -> list[None]:
        self.arguments_of[index].append(text)
        return []


def collect(events: Sequence[ToolEvent]) -> ParsedOutput:
    """Events joined into content and calls."""
    joined = _Collected()
    joined.handle(events)
    return ParsedOutput("".join(joined.content),
                        [ParsedCall(n, "".join(a)) for n, a in zip(joined.names, joined.arguments_of)])


class CallSyntax(Protocol):
    """How a model family writes a call: BEGIN {"name": NAME, "<key>": ARGUMENTS} END (pagoda.plugins.tools.ToolParser)."""

    begin: str  # "" = calls only at the start of the answer
    end: str
    key: str


class CallStream:
    """One answer's incremental reader: `feed(delta)` and `finish()` return the events they complete."""

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.header = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(syntax.key) + r'"\s*:\s*')
        self.text = ""
        self.pos = 0  # everything before it has been given out
        self.state = "text" if syntax.begin else "start"
        self.num_calls = 0
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
        self.pending = ""  # whitespace-only content, held: around calls it is dropped

    def feed(self, delta: str, final: bool = False) -> list[ToolEvent]:
        """The events `delta` completes; with `final`, the answer ends with it (`finish` follows)."""
        self.text += delta
        events: list[ToolEvent] = []
        while self._step(events):
            pass
        events = self._tidy(events, final=False)
        return events + self.finish() if final else events

    def finish(self) -> list[ToolEvent]:
        """The end of the answer: whatever was held back, and the end of an unfinished call."""
        events: list[ToolEvent] = []
        rest = self.text[self.pos:]
        if self.state == "args":
            if rest:
                events.append(ArgumentsDelta(self.num_calls - 1, rest))
            events.append(CallEnded(self.num_calls - 1))
        elif self.state == "close":
            events.append(CallEnded(self.num_calls - 1))
            rest = self._after_close(rest)
            if rest:
                events.append(TextDelta(rest))
        elif self.state == "header":
            events.append(TextDelta(self.syntax.begin + rest))
        elif rest.strip() or self.state == "text":
            if rest:
                events.append(TextDelta(rest))
        self.pos = len(self.text)
        self.state = "done"
        return self._tidy(events, final=True)

    def _tidy(self, events: list[ToolEvent], final: bool) -> list[ToolEvent]:
        """Trailing whitespace waits for what follows: text keeps it, a call drops it (so an answer that is only
        calls has no content), and so does the end of an answer that made calls; chunking never changes this."""
        out: list[ToolEvent] = []
        for e in events:
            if isinstance(e, TextDelta):
                body = e.text.rstrip()
                if not body:
                    self.pending += e.text
                    continue
                text, self.pending = self.pending + body, e.text[len(body):]
                e = TextDelta(text)
            elif isinstance(e, CallStarted):
                self.pending = ""
            out.append(e)
        if final:
            if self.pending and not self.num_calls:
                out.append(TextDelta(self.pending))
            self.pending = ""
        return out

    # -- the states ----------------------------------------------------------------------------------
    def _step(self, events: list[ToolEvent]) -> bool:
        """Advance one state if the text allows; False when more text is needed."""
        rest = self.text[self.pos:]
        if self.state == "start":  # a parser without BEGIN: a call only at the very start
            stripped = rest.lstrip()
            if stripped.startswith(PYTHON_TAG):
                stripped = stripped[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(stripped):
                return False  # nothing yet, or a partial tag
            if not stripped:
                return False
            if stripped.startswith("{"):
                self.pos += len(rest) - len(stripped)  # the marker and the whitespace are not content
                self.state = "header"
            else:
                self.state = "plain"
            return True
        if self.state == "plain":
            if rest:
                events.append(TextDelta(rest))
                self.pos = len(self.text)
            return False
        if self.state == "text":
            return self._text(rest, events)
        if self.state == "header":
            return self._header(rest, events)
        if self.state == "args":
            return self._args(rest, events)
        if self.state == "close":
            return self._close(rest, events)
        if self.state == "next":
            return self._next(events)
        return False

    def _text(self, rest: str, events: list[ToolEvent]) -> bool:
        begin = self.syntax.begin
        at = rest.find(begin)
        if at >= 0:
            if at:
                events.append(TextDelta(rest[:at]))
            self.pos += at + len(begin)
            self.state = "header"
            return True
        keep = next((n for n in range(min(len(begin) - 1, len(rest)), 0, -1) if begin.startswith(rest[-n:])), 0)
        if len(rest) > keep:
            events.append(TextDelta(rest[:len(rest) - keep]))
            self.pos += len(rest) - keep
        return False

    def _header(self, rest: str, events: list[ToolEvent]) -> bool:
        m = self.header.match(rest)
        if m is None:
            if self.syntax.end and self.syntax.end in rest or len(rest) > 4096:  # not a call after all
                events.append(TextDelta(self.syntax.begin + rest))
                self.pos = len(self.text)
                self.state = "text" if self.syntax.begin else "plain"
            return False
        events.append(CallStarted(self.num_calls, _unescape(m.group(1))))
        self.num_calls += 1
        self.pos += m.end()
        self.state = "args"
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
        return True

    def _args(self, rest: str, events: list[ToolEvent]) -> bool:
        if not self.started:  # whitespace before the value is the wrapper's, not the arguments'
            lead = len(rest) - len(rest.lstrip())
            self.pos += lead
            rest = rest[lead:]
        if not rest:
            return False
        n = self._scan(rest)
        if n:
            events.append(ArgumentsDelta(self.num_calls - 1, rest[:n]))
            self.pos += n
        if self.started and self.depth == 0 and not self.in_string:
            self.state = "close"
            return True
        return False

    def _scan(self, rest: str) -> int:
        """How many characters of `rest` belong to the arguments (up to the one that closes them)."""
        for i, c in enumerate(rest):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            if not self.started and not c.isspace():
                self.started = True
            if self.started and self.depth <= 0 and not self.in_string and (c in "}]" or c == '"'):
                self.depth = 0
                return i + 1
        return len(rest)

    def _close(self, rest: str, events: list[ToolEvent]) -> bool:
        m = re.match(self._closing(), rest)
        if m is not None:
            events.append(CallEnded(self.num_calls - 1))
            self.pos += m.end()
            self.state = "text" if self.syntax.begin else "next"
            if not self.syntax.begin:
                return self._next(events)
            return True
        if _may_become(rest, self.syntax.end):
            return False
        events.append(CallEnded(self.num_calls - 1))  # the wrapper never closed: what follows is content
        self.state = "text" if self.syntax.begin else "plain"
        return True

    def _next(self, events: list[ToolEvent]) -> bool:
        """After a call with no END: `;` and another call, or the rest is content."""
        rest = self.text[self.pos:]
        stripped = rest.lstrip()
        if not stripped:
            return False
        if stripped.startswith(";"):
            self.pos += len(rest) - len(stripped) + 1
            self.state = "header"
            return True
        self.state = "plain"
        return True

    def _closing(self) -> str:
        """The wrapper's `}` and END; with no END, whitespace after the brace is left to what follows."""
        return r"\s*\}" + (r"\s*" + re.escape(self.syntax.end) if self.syntax.end else "")

    def _after_close(self, rest: str) -> str:
        m = re.match(self._closing(), rest)
        return rest[m.end():] if m else rest


def _may_become(rest: str, end: str) -> bool:
    """`rest` could still grow into `}` + END (whitespace allowed around the brace)."""
    stripped = rest.lstrip()
    if not stripped:
        return True
    if not stripped.startswith("}"):
        return False
    tail = stripped[1:].lstrip()
    return end.startswith(tail) if end else tail == ""


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name
