"""Clients of a live pagoda server that follow a crowd's plans over real HTTP.

Each plan is one client speaking one protocol, streaming or not, that may hang
up part-way (a streaming client closes its response; a unary client cancels
its request, which closes the connection). The answer is normalised across the
four protocols to (text, finish reason, output tokens) so that a crowd run can
be compared with a solo run of the same plans.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from pagoda.simulator.crowd import ClientPlan

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


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


def request_body(plan: ClientPlan, model: str) -> dict:
    """The plan as the JSON body of its protocol."""
    text = plan.prompt_text or "Hello"
    sampling = {"temperature": plan.temperature, "top_p": plan.top_p, "stream": plan.stream}
    if plan.top_k:
        sampling["top_k"] = plan.top_k
    if plan.seed is not None:
        sampling["seed"] = plan.seed
    if plan.ignore_eos:
        sampling["ignore_eos"] = True
    if plan.protocol == "completions":
        body = {"prompt": text, "max_tokens": plan.max_tokens}
    elif plan.protocol == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": plan.max_tokens}
    elif plan.protocol == "responses":
        body = {"input": text, "max_output_tokens": plan.max_tokens}
    elif plan.protocol == "messages":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": plan.max_tokens}
    else:
        raise ValueError(f"plan {plan.client_id} has no protocol")
    if plan.stream and plan.protocol in ("completions", "chat"):
        body["stream_options"] = {"include_usage": True}
    return {"model": model, **body, **sampling}


class _Answer:
    """Accumulates one answer from a unary body or from stream events."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.parts: list[str] = []
        self.finish: str | None = None
        self.output_tokens: int | None = None
        self.prompt_tokens: int | None = None

    def _usage(self, usage: dict) -> None:
        self.output_tokens = usage.get("completion_tokens", usage.get("output_tokens"))
        self.prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens", self.prompt_tokens))

    def unary(self, body: dict) -> None:
        p = self.protocol
        if p in ("completions", "chat"):
            choice = body["choices"][0]
            self.parts.append(choice["text"] if p == "completions" else choice["message"]["content"] or "")
            self.finish = choice["finish_reason"]
        elif p == "responses":
            self.parts.append("".join(c["text"] for item in body["output"] for c in item.get("content", [])))
            self.finish = "length" if body["status"] == "incomplete" else "stop"
        else:
            self.parts.append("".join(block.get("text", "") for block in body["content"]))
            self.finish = "length" if body["stop_reason"] == "max_tokens" else "stop"
        self._usage(body["usage"])

    def event(self, data: dict) -> None:
        p = self.protocol
        if "error" in data and p != "messages" or data.get("type") == "error":
            raise RuntimeError(f"error event: {data}")
        if p in ("completions", "chat"):
            for choice in data.get("choices", []):
                self.parts.append(choice.get("text") or "" if p == "completions" else choice["delta"].get("content") or "")
                self.finish = choice.get("finish_reason") or self.finish
            if data.get("usage"):
                self._usage(data["usage"])
        elif p == "responses":
            if data["type"] == "response.output_text.delta":
                self.parts.append(data["delta"])
            elif data["type"] in ("response.completed", "response.incomplete"):
                response = data["response"]
                self.finish = "length" if response["status"] == "incomplete" else "stop"
                self._usage(response["usage"])
        else:
            if data["type"] == "message_start":
                self._usage(data["message"]["usage"])
            elif data["type"] == "content_block_delta":
                self.parts.append(data["delta"].get("text", ""))
            elif data["type"] == "message_delta":
                self.finish = "length" if data["delta"]["stop_reason"] == "max_tokens" else "stop"
                self.output_tokens = data["usage"]["output_tokens"]  # cumulative


async def run_client(http: httpx.AsyncClient, plan: ClientPlan, model: str, headers: dict | None = None) -> ClientOutcome:
    """Send one plan's request; hang up at `plan.hangup_after` seconds if it says so."""
    started = time.perf_counter()
    outcome = ClientOutcome(plan.client_id, status="failed")
    answer = _Answer(plan.protocol)
    work = asyncio.ensure_future(_exchange(http, plan, model, headers or {}, answer, outcome, started))
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
    outcome.text = "".join(answer.parts)
    outcome.finish_reason = {"end_turn": "stop", "stop_sequence": "stop"}.get(answer.finish, answer.finish)
    outcome.output_tokens = answer.output_tokens
    outcome.prompt_tokens = answer.prompt_tokens
    outcome.seconds = time.perf_counter() - started
    return outcome


async def _exchange(http, plan, model, headers, answer: _Answer, outcome: ClientOutcome, started: float) -> None:
    body = request_body(plan, model)
    path = PATHS[plan.protocol]
    if not plan.stream:
        response = await http.post(path, json=body, headers=headers)
        outcome.first_byte_seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        answer.unary(response.json())
        return
    async with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if outcome.first_byte_seconds is None:
                outcome.first_byte_seconds = time.perf_counter() - started
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            answer.event(json.loads(payload))
