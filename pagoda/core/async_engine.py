"""The engine on its own thread; asyncio callers talk to it through queues.

Design note. One thread (the loop thread) owns the `Engine` and is the only
one that touches it: adding requests, applying aborts, stepping, reading
stats, auditing. Callers on an asyncio event loop send it commands through a
lock-protected deque and get answers back through futures; step outputs go to
each request's `asyncio.Queue` via `call_soon_threadsafe`. When there is no
work and no command the loop thread sleeps on a condition variable, so an idle
server costs nothing.

Questions about the engine's state (`stats`, `audit`, `wait_until_idle`) are
commands too, answered by the loop thread between two steps. For /health,
which must answer at once under load, the loop thread also publishes a
snapshot of the stats after every turn (`latest_stats`): the loop's own
numbers as of its latest step, read without waiting for the step in progress,
and refused when that step has run too long (a stuck loop is not healthy). An abort is
queued and applied at the next step, so reading the pool from another thread
right after a caller left races that step; asking the loop thread does not.

A runner that loses part of itself (a tensor-parallel rank) cannot step again: its
`RunnerLost`, raised by a step or reported between steps (`lose`), ends the loop the
way a crash does: every caller is failed, /health says why, the runner is closed, and
`on_crash` (the server's exit, pagoda/cli/serve.py) is called.

The abort of a request lives in one place: the `finally` of `generate`. A
caller that stops consuming before the request finished (the task is
cancelled, the iterator is closed or dropped, an exception escapes) aborts it.

LoRA adapters. A load reads, checks and builds the adapter on a worker thread
(`Engine.prepare_adapter`: file reads, the finiteness scan, packing, the
invariance probe) while the loop steps on; only its install is a command. An
unload, once asked, goes on whether or not its caller still waits: a caller that
leaves (a client gone) stops its own wait, never the unload. When the loop ends
(stopped or crashed), every unload still waiting fails with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.core.adapters import AdapterInfo
from pagoda.core.engine import Engine
from pagoda.core.loop_channel import Command, Sink, post, refused, settle
from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams

logger = logging.getLogger("pagoda.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, stopped, or crashed)."""


class GenerationError(RuntimeError):
    """The model step running this request failed; the request has ended. `field`: the request field that made
    it fail (a constraint its model's vocabulary cannot follow), or None for the server's own failure."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestAborted(RuntimeError):
    """The request was aborted by the server (e.g. at shutdown), not by its caller."""


class AsyncEngine:
    """Runs an `Engine` on a dedicated thread; `generate` streams each request's outputs."""

    def __init__(self, engine: Engine, on_crash: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_crash = on_crash  # called on the loop thread once the loop has died and failed its callers
        self._lost: BaseException | None = None  # a loss the runner reported between steps (guarded by _cond)
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # why the loop died, if it did
        # Owned by the loop thread only:
        self._sinks: dict[str, Sink] = {}
        self._idle_waiters: list[concurrent.futures.Future[None]] = []
        self.num_wakeups = 0  # loop iterations; lets tests see that an idle loop sleeps
        # Written by the loop thread, read by any (a reference swap is atomic): its latest stats, and
        # when the step in progress began (None between steps).
        self._snapshot: dict[str, int] = {}
        self._step_started: float | None = None

    # -- lifecycle -----------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._snapshot = self.engine.stats()  # the loop thread is not running yet: this thread may read
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()
        watch = getattr(self.engine.runner, "watch", None)
        if watch is not None:
            watch(self.lose)

    def lose(self, failure: BaseException) -> None:
        """From any thread: the runner cannot step again; the loop ends as if its step had raised `failure`."""
        with self._cond:
            self._lost = failure
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every live request, stop the loop thread and wait for it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    @property
    def failure(self) -> BaseException | None:
        """Why the loop died, if it did."""
        return self._failure

    # -- requests ------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None,
        *, on_admitted: Callable[[], None] | None = None, cache_salt: str | None = None, tenant: str | None = None,
        priority: int = 0, weight: float = 1.0, adapter: str | None = None,
    ) -> AsyncIterator[AnswerDelta]:
        """Queue a request and yield its outputs as the engine makes them; the last one is finished.

        Admission errors (AdmissionError, ValueError) are raised before the first output;
        `on_admitted` is called once the engine has accepted the request (before its prefill).
        `cache_salt` and `tenant` key the prefix cache (Engine.add_request): blocks are shared only under equal ones.
        `tenant`, `priority` and `weight` are what the scheduling policy orders by (core/scheduling.py).
        `adapter`: the loaded LoRA adapter the request's rows add (None: the base model).
        A failed model step raises GenerationError; a server-side abort raises RequestAborted.
        """
        request_id = request_id or uuid.uuid4().hex
        sink = Sink(asyncio.get_running_loop())
        prompt = list(prompt_token_ids)
        if sampling_params.constraint is not None:  # compiled on the grammar pool, never on the loop thread;
            # shielded: the compile may be shared with other requests, a caller leaving must not cancel it
            await asyncio.shield(asyncio.wrap_future(self.engine.compile_constraint(sampling_params.constraint)))
        keys = {"cache_salt": cache_salt, "tenant": tenant, "priority": priority, "weight": weight, "adapter": adapter}
        admitted = self._submit(lambda: self._add(request_id, prompt, sampling_params, sink, keys), answer=True)
        finished = False
        try:
            await asyncio.wrap_future(admitted)
            if on_admitted is not None:
                on_admitted()
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the loop died; nothing left to abort
                    raise item
                finished = item.finished
                if item.finish_reason is FinishReason.ERROR:
                    raise GenerationError(item.error or "the model step failed", item.error_field)
                if item.finish_reason is FinishReason.ABORT:
                    raise RequestAborted(f"request {request_id} was aborted by the server")
                yield item
        finally:
            # Every way out before the end (cancel, close, exception) aborts the request.
            if not finished and not refused(admitted):
                self._submit_quietly(lambda: self._abort(request_id))

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink,
             keys: dict[str, Any]) -> None:
        self.engine.add_request(request_id, prompt, params, **keys)  # raises for a request it refuses
        self._sinks[request_id] = sink

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)  # the caller is gone: its abort output goes nowhere
        self.engine.abort(request_id)

    # -- questions answered by the loop thread -------------------------
    async def stats(self) -> dict[str, int]:
        """The engine's counters and queue sizes, read between two steps."""
        return await self._ask(self.engine.stats)

    def latest_stats(self, stuck_after: float) -> dict[str, int]:
        """The stats the loop published after its latest turn, at once; EngineDeadError when it cannot serve.

        "Cannot serve": the loop is not running, or its step in progress began over `stuck_after` seconds ago.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop crashed: {self._failure!r}" if self._failure is not None
                                  else "the engine loop is not running")
        started = self._step_started
        if started is not None and time.monotonic() - started > stuck_after:
            raise EngineDeadError(f"the engine step in progress has run for over {stuck_after:g} s")
        return self._snapshot

    # -- LoRA adapters ---------------------------------------------------
    @property
    def adapters(self) -> dict[str, AdapterInfo]:
        """The adapters a request may name now, by name (read from any thread)."""
        return self.engine.adapters.snapshot

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a LoRA adapter (AdapterError, naming the field, when it is refused): prepared on a worker thread
        while the engine steps on, installed between two steps."""
        prepared = await asyncio.to_thread(self.engine.prepare_adapter, name, path)
        return await self._ask(lambda: self.engine.install_adapter(prepared))

    async def unload_adapter(self, name: str) -> AdapterInfo:
        """Unload an adapter once its last live request has ended (UnknownAdapter when it is not loaded; the
        runner's error when its unload failed; EngineDeadError when the loop ends first).

        Shielded: a caller that is cancelled stops waiting, and the unload goes on (the engine's future is never
        cancelled under it)."""
        unload = asyncio.ensure_future(self._unload_adapter(name))
        unload.add_done_callback(_outcome_read)  # nobody may read it: its caller left
        return await asyncio.shield(unload)

    async def _unload_adapter(self, name: str) -> AdapterInfo:
        future = await self._ask(lambda: self.engine.unload_adapter(name))
        return await asyncio.wrap_future(future)

    async def audit(self) -> None:
        """Run the engine's ledger audit between two steps (raises AuditError)."""
        await self._ask(self.engine.audit)

    async def wait_until_idle(self) -> None:
        """Return once no request is waiting, running or pending abort."""
        idle: concurrent.futures.Future[None] = concurrent.futures.Future()

        def park() -> None:
            if self.engine.has_unfinished():
                self._idle_waiters.append(idle)
            else:
                settle(idle, None)

        self._submit(park)
        await asyncio.wrap_future(idle)

    async def _ask(self, question: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(question, answer=True))

    # -- talking to the loop thread ------------------------------------
    def _submit(self, fn: Callable[[], Any], *, answer: bool = False) -> concurrent.futures.Future[Any] | None:
        command = Command(fn, concurrent.futures.Future() if answer else None)
        with self._cond:
            if self._failure is not None:
                raise EngineDeadError(f"the engine loop crashed: {self._failure!r}")
            if self._thread is None or self._stopping:
                raise EngineDeadError("the engine loop is not running")
            self._commands.append(command)
            self._cond.notify()
        return command.answer

    def _submit_quietly(self, fn: Callable[[], Any]) -> None:
        # From a `finally`: with the loop gone there is nothing to abort.
        try:
            self._submit(fn)
        except EngineDeadError:
            pass

    # -- the loop thread -----------------------------------------------
    def _run(self) -> None:
        try:
            while self._turn():
                pass
            self._shutdown()
            self._close_engine()
        except BaseException as exc:  # a bug in the engine, or a lost runner: fail every caller instead of hanging
            logger.exception("the engine loop crashed")
            with self._cond:
                self._failure = exc
                pending = list(self._commands)
                self._commands.clear()
            error = EngineDeadError(f"the engine loop crashed: {exc!r}")
            for command in pending:
                if command.answer is not None:
                    settle(command.answer, error, failed=True)
            self._fail_everyone(error)
            self._close_engine()
            if self.on_crash is not None:
                self.on_crash(exc)

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:
            logger.exception("closing the engine's runner failed")

    def _turn(self) -> bool:
        """Run queued commands, then one step if there is work; False once stopping."""
        with self._cond:
            while (not self._commands and not self._stopping and not self.engine.has_unfinished()
                   and self._lost is None):
                self._cond.wait()
            if self._lost is not None:
                raise self._lost
            commands = list(self._commands)
            self._commands.clear()
            stopping = self._stopping
        self.num_wakeups += 1
        for command in commands:
            command.run()
        if stopping:
            return False
        if self.engine.has_unfinished() and (wait := self.engine.anticipation()) > 0:
            with self._cond:  # the policy expects a request within `wait`: its arrival (or a stop) ends the wait
                if not self._commands and not self._stopping:
                    self._cond.wait(wait)
                late = list(self._commands)
                self._commands.clear()
            for command in late:
                command.run()
            commands += late
        if commands:  # admissions and aborts show before the step they wait for
            self._snapshot = self.engine.stats()
        if self.engine.has_unfinished():
            self._step_started = time.monotonic()
            outputs = self.engine.step()
            self._step_started = None
            self._snapshot = self.engine.stats()  # before delivery: a caller that saw its end sees it counted
            self._deliver(outputs)
        if self._idle_waiters and not self.engine.has_unfinished():
            for waiter in self._idle_waiters:
                settle(waiter, None)
            self._idle_waiters.clear()
        return True

    def _deliver(self, outputs: list[AnswerDelta]) -> None:
        """Hand each output to its request's queue (a finished request's sink is dropped)."""
        items = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                items.append((sink, out))
        post(items)

    def _shutdown(self) -> None:
        """Abort what is live so that its callers hear about it, then fail whoever still waits."""
        if self.engine.grammars is not None:
            self.engine.grammars.shutdown()
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        if self.engine.has_unfinished():
            self._deliver(self.engine.step())
        self._fail_everyone(EngineDeadError("the engine loop stopped"))

    def _fail_everyone(self, error: BaseException) -> None:
        for waiter in self._idle_waiters:
            settle(waiter, error, failed=True)
        self._idle_waiters.clear()
        for unload in self.engine.adapters.pending_unloads():  # no step will end their adapters' requests now
            settle(unload, error, failed=True)
        sinks, self._sinks = self._sinks, {}
        post([(sink, error) for sink in sinks.values()])


def _outcome_read(task: asyncio.Future[Any]) -> None:
    """Mark a task's outcome as read (no "exception was never retrieved" for a caller that left)."""
    if not task.cancelled():
        task.exception()
