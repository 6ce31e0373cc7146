"""Several choices in one request: a prompt list, `n` samples of each.

    prepare  -> [EngineRequest(prompt_i, n)]       one per prompt, in order
    fan_out  -> [EngineRequest] of n*len(prompts)  choice index = prompt_i * n + j (OpenAI's order)

Choice j of a prompt is the request that prompt would make alone with seed + j
(when a seed is given), so each choice can be reproduced on its own; greedy
choices are identical. The server runs one engine request per choice as one
job (pagoda.api.generation), so a disconnect or a failure ends all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from pagoda.plugins.protocol import EngineRequest, Exchange, ExchangeState
from pagoda.plugins.request_fields import RequestError

T = TypeVar("T")

MAX_CHOICES = 128  # engine requests one HTTP request may make (prompts x n)


def fan_out(prepared: EngineRequest | Sequence[EngineRequest]) -> list[EngineRequest]:
    """One EngineRequest per choice (n = 1 each), choice j of a prompt seeded seed + j; too many is a 400 naming `n`."""
    requests = [prepared] if isinstance(prepared, EngineRequest) else list(prepared)
    total = sum(r.n for r in requests)
    if total > MAX_CHOICES:
        raise RequestError(f"n times the number of prompts may be at most {MAX_CHOICES}, got {total}", "n")
    choices = []
    for r in requests:
        for j in range(r.n):
            params = r.sampling_params
            if j and params.seed is not None:
                try:
                    params = dataclasses.replace(params, seed=params.seed + j)
                except ValueError:
                    raise RequestError(f"seed + n - 1 must stay a 64-bit integer, got {params.seed + j}", "seed") from None
            choices.append(dataclasses.replace(r, sampling_params=params, n=1))
    return choices


def choice_exchange(exchange: Exchange, index: int) -> Exchange:
    """The exchange as choice `index`'s renderer sees it: its own engine request and notes."""
    if not exchange.choices and index == 0:
        return exchange
    return dataclasses.replace(exchange, request=exchange.choices[index], index=index, state=ExchangeState())


async def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several async iterators as they come; the first failure closes the others and is raised."""
    pending = {asyncio.ensure_future(anext(it)): it for it in iterators}  # each: the iterator's next item
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                it = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(it))] = it
                yield item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
