"""The load patterns of `pagoda bench serve`: closed-loop clients, open-loop Poisson arrivals, chat conversations.

    closed loop  N clients; each sends its next request as soon as its previous one finished,
                 until `num_requests` have been sent
    open loop    requests arrive at `rate` per second, exponential gaps from a seeded generator,
                 whether or not earlier ones finished
    chat         one client per conversation; turn t resends the whole history (system prompt,
                 every earlier user message and answer) plus user message t
    tenants      closed loops per tenant, each with its own key, side by side, until one tenant has
                 finished its requests (--tenant-mix: tenant_mix.py)

Every level is bounded: each request by its own timeout, the level by the
run's deadline (what is still in flight then is cancelled and recorded so).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import httpx
from tqdm import tqdm

from pagoda.bench.serve.client import CANCELLED, RequestRecord, Target, ask_for, stream_request
from pagoda.bench.serve.workloads import Conversation, Prompt

STOPPED = "in flight when the loops stopped"  # the error of another tenant's request cut off by tenant_loops


@dataclass(frozen=True)
class LoadConfig:
    """How every request of a run is sent."""

    endpoint: str = "completions"  # completions | chat
    temperature: float = 0.0
    request_timeout: float = 300.0
    progress: bool = True


@dataclass
class LevelRun:
    """The records of one level against one server, and how long it took."""

    records: list[RequestRecord] = field(default_factory=list)
    duration: float = 0.0  # from the level's start to its last request's end
    deadline_hit: bool = False
    client_cpu: float = 0.0  # CPU seconds this process (the load's client) spent meanwhile: it shares the machine


def merged(runs: list[LevelRun]) -> LevelRun:
    """One level run in several rounds, as one: every record, the rounds' durations added."""
    return LevelRun([r for run in runs for r in run.records], sum(run.duration for run in runs),
                    any(run.deadline_hit for run in runs), sum(run.client_cpu for run in runs))


class _Level:
    """Shared state of one level: the clock, the records, the progress bar."""

    def __init__(self, http: httpx.AsyncClient, target: Target, cfg: LoadConfig, level: float, total: int | None,
                 label: str, t0: float | None = None) -> None:
        self.http, self.target, self.cfg, self.level = http, target, cfg, level
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time() if t0 is None else t0  # levels run side by side share one clock
        self.cpu0 = time.process_time()
        self.run = LevelRun()
        self.bar = tqdm(total=total, desc=f"{target.name} {label}", leave=False, disable=not cfg.progress)

    async def send(self, index: int, endpoint: str, prompt: str, max_tokens: int, *, system: str | None = None,
                   history: tuple[tuple[str, str], ...] = (), **where: int) -> tuple[RequestRecord, str]:
        record = RequestRecord(self.target.name, self.level, index, start=self.loop.time() - self.t0, **where)
        self.run.records.append(record)
        ask = ask_for(self.target.model, prompt, max_tokens, self.cfg.temperature, system=system, history=history)
        text = await stream_request(self.http, self.target, endpoint, ask, record, self.cfg.request_timeout)
        self.run.duration = max(self.run.duration, self.loop.time() - self.t0)
        self.bar.update(1)
        return record, text

    async def until(self, deadline: float, work: Awaitable[object]) -> LevelRun:
        """Await the level's work, cancelling it at the run's deadline."""
        try:
            await asyncio.wait_for(work, max(0.0, deadline - self.loop.time()))
        except TimeoutError:
            self.run.deadline_hit = True
            self.run.duration = self.loop.time() - self.t0
        finally:
            self.bar.close()
            self.run.client_cpu = time.process_time() - self.cpu0
        return self.run


async def closed_loop(http: httpx.AsyncClient, target: Target, cfg: LoadConfig, prompts: list[Prompt],
                      num_requests: int, concurrency: int, deadline: float, first: int = 0) -> LevelRun:
    """`concurrency` clients, back to back, until `num_requests` were sent (request indices from `first`)."""
    level = _Level(http, target, cfg, concurrency, num_requests, f"concurrency={concurrency}")
    counter = iter(range(first, first + num_requests))

    async def client() -> None:
        for i in counter:  # shared: each index is taken by exactly one client
            p = prompts[i % len(prompts)]
            await level.send(i, cfg.endpoint, p.text, p.max_tokens)

    return await level.until(deadline, asyncio.gather(*(client() for _ in range(concurrency))))


async def open_loop(http: httpx.AsyncClient, target: Target, cfg: LoadConfig, prompts: list[Prompt],
                    num_requests: int, rate: float, seed: int, deadline: float) -> LevelRun:
    """`num_requests` Poisson arrivals at `rate` per second (the same arrival times for every server)."""
    level = _Level(http, target, cfg, rate, num_requests, f"rate={rate:g}/s")
    rng = random.Random(seed)

    async def arrivals() -> None:
        tasks = []
        try:
            for i in range(num_requests):
                p = prompts[i % len(prompts)]
                tasks.append(asyncio.ensure_future(level.send(i, cfg.endpoint, p.text, p.max_tokens)))
                if i + 1 < num_requests:
                    await asyncio.sleep(rng.expovariate(rate))  # the schedule itself, not a wait for a condition
            await asyncio.gather(*tasks)
        finally:  # at the deadline: what is in flight is cancelled, and records it
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return await level.until(deadline, arrivals())


async def chat(http: httpx.AsyncClient, target: Target, cfg: LoadConfig, convs: list[Conversation],
               max_tokens: int, deadline: float) -> LevelRun:
    """Each conversation's turns in order, all conversations at once, over /v1/chat/completions."""
    total = sum(len(c.user_turns) for c in convs)
    level = _Level(http, target, cfg, len(convs), total, f"conversations={len(convs)}")

    async def conversation(c: int, conv: Conversation) -> None:
        history: tuple[tuple[str, str], ...] = ()  # (user message, answer) of each earlier turn
        for turn, user in enumerate(conv.user_turns):
            if conv.think_s:
                await asyncio.sleep(conv.think_s[turn])  # the user reading and typing: part of the workload
            record, text = await level.send(c * len(conv.user_turns) + turn, "chat", user, max_tokens,
                                            system=conv.system, history=history, conversation=c, turn=turn)
            if not record.ok:
                return  # a conversation whose turn failed has no history to go on with
            history += ((user, text),)

    return await level.until(deadline, asyncio.gather(*(conversation(c, conv) for c, conv in enumerate(convs))))


async def tenant_loops(http: httpx.AsyncClient, targets: dict[str, Target], streams: dict[str, int], cfg: LoadConfig,
                       prompt: Callable[[str, int], Prompt], until: str, num_requests: int,
                       deadline: float, pause: Callable[[str, int], float] | None = None) -> dict[str, LevelRun]:
    """Each tenant's streams in closed loops, each tenant with its own target (its key), until tenant `until` has
    sent and finished `num_requests`; the other tenants keep sending until then, and what they have in flight is
    cancelled then (recorded so, with what streamed before). Request i of tenant t sends `prompt(t, i)`, after
    a pause of `pause(t, i)` seconds when given (a client's own time between an answer and its next request).
    One clock for all: record starts are seconds since the loops began."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    levels = {name: _Level(http, target, cfg if name == until else replace(cfg, progress=False), streams[name],
                           num_requests if name == until else None, f"tenant {name}", t0)
              for name, target in targets.items()}

    def clients(name: str) -> list[Awaitable[None]]:
        counter = iter(range(num_requests)) if name == until else itertools.count()

        async def client() -> None:
            for i in counter:  # shared: each index is taken by exactly one of the tenant's streams
                if pause is not None:
                    await asyncio.sleep(pause(name, i))
                p = prompt(name, i)
                await levels[name].send(i, cfg.endpoint, p.text, p.max_tokens)

        return [client() for _ in range(streams[name])]

    others = [asyncio.ensure_future(c) for name in targets if name != until for c in clients(name)]
    try:
        await levels[until].until(deadline, asyncio.gather(*clients(until)))
    finally:
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
    end = loop.time() - t0
    for name, level in levels.items():
        if name != until:
            level.bar.close()
            level.run.duration = end
            level.run.deadline_hit = levels[until].run.deadline_hit
        for record in level.run.records:
            record.tenant = name
            if name != until and not record.ok and record.error == CANCELLED:
                record.error = STOPPED  # stopped with the loops: unfinished, but not a failure
    levels[until].run.duration = max(levels[until].run.duration, end)
    return {name: level.run for name, level in levels.items()}


async def warm_up(http: httpx.AsyncClient, target: Target, cfg: LoadConfig, prompt: Prompt) -> RequestRecord:
    """One short request before any level, not recorded: first-request costs stay out of the numbers."""
    record = RequestRecord(target.name, 0, -1, 0.0)
    ask = ask_for(target.model, prompt.text, min(prompt.max_tokens, 8), cfg.temperature)
    await stream_request(http, target, cfg.endpoint, ask, record, cfg.request_timeout)
    return record
