"""The renderer base every protocol's tool-call answer uses: the reading loop and the call ids, once.

An answer with a tool parser is read as it comes, each step's text fed to the parser's `CallStream` and the
stream finished with the answer's last delta; the unary body is the same reading of the whole text. A protocol
subclasses `ToolRenderer` and says only what each event becomes on its wire (`ToolEvents`' four methods):

    chat       a delta per event: content, a call's id and name, an arguments fragment
    responses  output items (a message per stretch of text, a function_call per call) and their events
    messages   content blocks (text, tool_use) and their content_block_* events

A call's id is made once per exchange (`call_id(index)`, from the exchange's own notes), so the stream and the
body it ends with name every call alike.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

from pagoda.core.outputs import AnswerDelta
from pagoda.plugins.protocol import Exchange
from pagoda.plugins.tool_stream import CallStream, ToolEvents

T = TypeVar("T")


class ToolRenderer(ToolEvents[T]):
    """One answer read for tool calls and mapped to a protocol's wire items (the exchange's parser reads it)."""

    call_id_prefix: ClassVar[str] = "call_"  # the protocol's prefix of a call's id

    def __init__(self, exchange: Exchange) -> None:
        parser = exchange.request.tool_parser
        if parser is None:
            raise ValueError(f"exchange {exchange.id} has no tool parser: its answer is plain text")
        self.exchange = exchange
        self.reader: CallStream = parser.stream()

    def delta(self, delta: AnswerDelta) -> list[T]:
        """The wire items of one step's answer delta (the last one also ends the reading)."""
        return self.handle(self.reader.feed(delta.new_text, final=delta.finished))

    def whole(self, text: str) -> list[T]:
        """The wire items of a whole answer at once (a unary body: the same reading as the stream's)."""
        return self.handle(self.reader.feed(text, final=True))

    def call_id(self, index: int) -> str:
        """The id of the answer's call number `index`: the same in the stream and in the final body."""
        return self.exchange.state.id(self.call_id_prefix, index)

    @property
    def num_calls(self) -> int:
        """Calls begun so far."""
        return self.reader.num_calls
