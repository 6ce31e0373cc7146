"""How asyncio callers and the engine's loop thread hand things to each other (pagoda/core/async_engine.py).

Callers send the loop thread `Command`s and wait on futures that the loop settles; the loop thread
delivers each request's outputs to its `Sink`, an asyncio queue on the caller's event loop, with one
`call_soon_threadsafe` hop per event loop and step rather than one per output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.core.outputs import AnswerDelta


@dataclass
class Command:
    """Work for the loop thread; `answer` (if any) gets its result or exception."""

    fn: Callable[[], Any]
    answer: concurrent.futures.Future[Any] | None = None

    def run(self) -> None:
        if self.answer is None:
            self.fn()
            return
        if not self.answer.set_running_or_notify_cancel():
            return  # the caller stopped waiting before the loop got to it
        try:
            result = self.fn()
        except Exception as exc:  # AdmissionError, AuditError, ...: raised in the caller
            self.answer.set_exception(exc)
        else:
            self.answer.set_result(result)


class Sink:
    """Where the loop thread delivers one request's outputs: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[AnswerDelta | BaseException] = asyncio.Queue()


def post(items: list[tuple[Sink, AnswerDelta | BaseException]]) -> None:
    """Put items on their sinks' queues: one thread hop per event loop, not per item."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, AnswerDelta | BaseException]]] = {}
    for sink, item in items:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed: its callers are gone
            pass


def _put_all(items: list[tuple[Sink, AnswerDelta | BaseException]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)


def settle(future: concurrent.futures.Future[Any], value: Any, *, failed: bool = False) -> None:
    """Resolve a future the caller may have cancelled meanwhile."""
    if future.done():
        return
    try:
        if failed:
            future.set_exception(value)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def refused(admitted: concurrent.futures.Future[None]) -> bool:
    """True when the engine refused the request (so there is nothing to abort)."""
    return admitted.done() and not admitted.cancelled() and admitted.exception() is not None
