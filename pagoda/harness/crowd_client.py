"""Clients of a live pagoda server that follow a crowd's plans over real HTTP.

Each plan is one client speaking one protocol, streaming or not, that may hang
up part-way (a streaming client closes its response; a unary client cancels
its request, which closes the connection). The protocol is resolved against
the server's registered endpoints: each endpoint's client half builds the body
and reads the answer, normalised across protocols to (text, finish reason,
token counts), so that a crowd run can be compared with a solo run of the same
plans. The exchange itself is `pagoda.plugins.client.send`, the one client stack.

A plan that follows another (`after`) is the next turn of that client's
conversation: it is sent with the earlier turns as its history (a chat
endpoint sends them as messages, a plain-prompt one as text before its own),
so its prompt begins with the one before and the answer it got.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx

from pagoda.plugins.client import ClientRequest, send
from pagoda.plugins.protocol import Endpoint
from pagoda.simulator.crowd import ClientPlan

Endpoints = Mapping[str, Endpoint]  # protocol name -> endpoint (pagoda.plugins.manager.registered_endpoints)


@dataclass
class ClientOutcome:
    client_id: str
    status: str  # completed | hung_up | failed
    text: str = ""
    finish_reason: str | None = None  # normalised: stop | length
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    first_byte_seconds: float | None = None
    seconds: float = 0.0
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache
    # the conversation after this turn, (user text, answer) each: what a follow-up of this client sends first
    conversation: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def client_request(plan: ClientPlan, model: str, history: tuple[tuple[str, str], ...] = (),
                   cache_salt: str | None = None) -> ClientRequest:
    """The plan as a generic request, for its endpoint to put in its own words (`cache_salt` overrides the plan's;
    a plan on a LoRA adapter asks for the adapter's name as its model)."""
    return ClientRequest(prompt=plan.prompt_text or "Hello", max_tokens=plan.max_tokens, stream=plan.stream,
                         temperature=plan.temperature, top_p=plan.top_p, top_k=plan.top_k, seed=plan.seed,
                         ignore_eos=plan.ignore_eos, model=plan.adapter or model,  # a LoRA adapter: its name
                         cache_salt=cache_salt or plan.cache_salt,
                         history=history, json_schema=json.loads(plan.json_schema) if plan.json_schema else None)


def check_protocols(plans: Iterable[ClientPlan], endpoints: Endpoints) -> None:
    """Every plan names a protocol the server has an endpoint for (before any request is sent)."""
    for plan in plans:
        if plan.protocol not in endpoints:
            raise ValueError(f"plan {plan.client_id}: protocol {plan.protocol!r} is not served here"
                             f" (endpoints: {', '.join(sorted(endpoints))})")


async def run_client(http: httpx.AsyncClient, plan: ClientPlan, model: str, endpoints: Endpoints,
                     headers: dict | None = None, *, history: tuple[tuple[str, str], ...] = (),
                     cache_salt: str | None = None) -> ClientOutcome:
    """Send one plan's request to its protocol's endpoint; hang up at `plan.hangup_after` seconds if it says so.

    `history`: the conversation before this turn (a follow-up's: its predecessor's `conversation`).
    """
    check_protocols([plan], endpoints)
    endpoint = endpoints[plan.protocol]
    started = time.perf_counter()
    outcome = ClientOutcome(plan.client_id, status="failed")
    answer = endpoint.client_answer()
    ask = client_request(plan, model, history, cache_salt)

    def first_byte() -> None:
        outcome.first_byte_seconds = time.perf_counter() - started

    work = asyncio.ensure_future(send(http, endpoint, ask, headers=headers or {}, answer=answer,
                                      on_first_byte=first_byte))
    try:
        if plan.hangup_after is None:
            await work
        else:
            done, _ = await asyncio.wait({work}, timeout=plan.hangup_after)
            if not done:
                work.cancel()  # closes the response, and with it the connection
                await asyncio.gather(work, return_exceptions=True)
                outcome.status = "hung_up"
            else:
                work.result()
        if outcome.status != "hung_up":
            outcome.status = "completed"
    except Exception as exc:  # the outcome records it; the crowd goes on
        outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"
    outcome.text = answer.text
    outcome.finish_reason = answer.finish_reason
    outcome.output_tokens = answer.output_tokens
    outcome.prompt_tokens = answer.prompt_tokens
    outcome.cached_tokens = answer.cached_tokens
    outcome.conversation = (*history, (ask.prompt, answer.text))
    outcome.seconds = time.perf_counter() - started
    return outcome
