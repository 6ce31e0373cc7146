"""The fakes and helpers the tests share, in one place.

- engines: `fake_engine` (the simulator's fake model under the real engine), `drain`, `tokens`;
- waiting: `run` (a coroutine with a deadline), `wait_for` and `await_condition` (poll with a deadline,
  never a fixed sleep), `metric_values` (a server's /metrics samples);
- ASGI: `FakeConnection`, a scripted connection whose sends can fail or hang;
- protocols: a fake tokenizer and ServeContext, bodies decoded as the server decodes them, engine outputs
  made by hand, and the server's own SSE/NDJSON encoders to hand a stream to an endpoint's client half.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api.stream_writer import ENCODERS
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.outputs import AnswerDelta, SampledToken
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.tool_parsers import HERMES
from pagoda.plugins.client import ClientAnswer, line_data
from pagoda.plugins.choices import fan_out
from pagoda.plugins.protocol import Answer, Endpoint, Event, Exchange, ServeContext
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner


# -- engines -------------------------------------------------------------------------------------------

def fake_engine(num_blocks=16, block_size=4, max_running=4, max_batched_tokens=64, max_model_len=256,
                enable_prefix_caching=True, **kw) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_running=max_running,
        max_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    runner = FakeModelRunner(num_blocks, block_size, vocab_size=64, eos_bias=-50.0)  # EOS never wins
    return Engine(runner, config, eos_token_ids=(EOS_TOKEN_ID,), **kw)


def drain(engine: Engine, limit: int = 10_000) -> dict[str, list]:
    """Step until idle; returns each request's outputs. Audits after every step."""
    outputs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.audit()
    raise AssertionError("engine did not drain")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]

# -- waiting -------------------------------------------------------------------------------------------

def run(coro, timeout: float = 60.0):
    """Run a coroutine to its end, failing it after `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `condition` until true (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def await_condition(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """`wait_for` inside an event loop: poll `condition`, yielding to the loop between looks."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def metric_values(url: str) -> dict[str, float]:
    """The /metrics samples as {'name{label=value,...}': value} (histogram buckets left out)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


# -- ASGI ----------------------------------------------------------------------------------------------

class FakeConnection:
    """A scripted ASGI connection.

    `receive` hands out the queued messages (`leave()` queues a disconnect), then waits. `send` records
    every message; once armed (at once, unless `armed=False` until `arm()`), a send of the kind it trips on
    (every message, or only body messages with `bodies_only`) raises `fail_with`, or never completes when
    it is message number `hang_from` or later: like uvicorn's send waiting for a drain that never comes.
    """

    def __init__(self, *incoming: dict[str, Any], fail_with: BaseException | None = None,
                 hang_from: int | None = None, bodies_only: bool = False, armed: bool = True) -> None:
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for message in incoming:
            self.incoming.put_nowait(message)
        self.messages: list[dict[str, Any]] = []
        self.reads = 0
        self.fail_with, self.hang_from, self.bodies_only, self.armed = fail_with, hang_from, bodies_only, armed

    @classmethod
    def with_json(cls, body: Any, **options: Any) -> FakeConnection:
        """A connection whose request body is `body` as JSON."""
        message = {"type": "http.request", "body": msgspec.json.encode(body), "more_body": False}
        return cls(message, **options)

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        return await self.incoming.get()

    async def send(self, message: dict[str, Any]) -> None:
        trips = self.armed and (not self.bodies_only or message["type"] == "http.response.body")
        if trips and self.hang_from is not None and len(self.messages) >= self.hang_from:
            await asyncio.Event().wait()
        if trips and self.fail_with is not None:
            raise self.fail_with
        self.messages.append(message)

    def arm(self) -> None:
        self.armed = True

    def leave(self) -> None:
        self.incoming.put_nowait({"type": "http.disconnect"})

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]

    def events(self) -> int:
        """SSE data lines written so far."""
        return sum(body.count(b"data: ") for body in self.bodies)


# -- protocols -----------------------------------------------------------------------------------------

class FakeTokenizer:
    """One token per character (id = code point); a chat is its messages as `<role>content`, then `<assistant>`."""

    has_chat_template = True
    chat_template_takes_tools = False

    def __init__(self) -> None:
        self.chats: list[list[dict[str, str]]] = []  # every conversation encode_chat was given

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        self.chats.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def context(max_model_len: int = 256, max_kv_tokens: int = 512, tool_parser: Any = HERMES) -> ServeContext:
    """A ServeContext over a fresh FakeTokenizer (tool calls read by the default parser, hermes)."""
    return ServeContext(tokenizer=FakeTokenizer(), model_name="m", max_model_len=max_model_len,
                        max_kv_tokens=max_kv_tokens, tool_parser=tool_parser)


def decode(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    """The JSON body decoded into the endpoint's Struct, as the server's msgspec decoding does (or raises)."""
    return msgspec.json.decode(msgspec.json.encode(body), type=endpoint.body_type)


def prepared(endpoint: Endpoint, body: dict[str, Any], ctx: ServeContext | None = None) -> Exchange:
    """The Exchange the renderers see for this body: decoded, prepared, with an id and a model name."""
    ctx = ctx or context()
    struct = decode(endpoint, body)
    choices = fan_out(endpoint.prepare(struct, ctx))  # one EngineRequest per choice, as the server makes them
    return Exchange(id=endpoint.new_id(), created=1700000000, model=ctx.model_name, body=struct, request=choices[0],
                tokenizer=ctx.tokenizer, choices=choices)


def outputs(call: Exchange, texts: Sequence[str], reason: FinishReason = FinishReason.LENGTH,
            stop_reason: str | int | None = None, logprobs: bool = False, cached: int = 0) -> list[AnswerDelta]:
    """One output per text (one token each, id = its first character), the last one finished with `reason`;
    `cached` prompt tokens found in the prefix cache."""
    outs = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        token = ord(text[0]) if text else 1
        outs.append(AnswerDelta(
            request_id=call.id, new_token_ids=[token], new_text=text, finished=last,
            finish_reason=reason if last else None, num_prompt_tokens=call.num_prompt_tokens,
            num_output_tokens=i + 1, stop_reason=stop_reason if last else None, num_cached_tokens=cached,
            logprobs=[SampledToken(token, -0.5, ((token, -0.5), (66, -1.5)))] if logprobs else []))
    return outs


def completion(call: Exchange, texts: Sequence[str], **kw: Any) -> Answer:
    """The unary renderers' view of the same outputs."""
    return Answer.from_deltas(outputs(call, texts, **kw))


def stream(endpoint: Endpoint, call: Exchange, outs: Sequence[AnswerDelta]) -> list[Event]:
    """Every event render_stream produces from these outputs."""
    async def collect() -> list[Event]:
        async def feed():
            for out in outs:
                yield out

        return [event async for event in endpoint.render_stream(call, feed())]

    return asyncio.run(collect())


def read_stream(endpoint: Endpoint, events: Sequence[Event]) -> ClientAnswer:
    """The endpoint's client half reading these events off the wire: encoded as the server does, split in lines."""
    answer = endpoint.client_answer()
    wire = b"".join(ENCODERS[endpoint.stream_format](event) for event in events).decode()
    for line in wire.splitlines():
        data = line_data(endpoint.stream_format, line)
        if data is not None:
            answer.event(data)
    return answer


def read_unary(endpoint: Endpoint, body: dict[str, Any]) -> ClientAnswer:
    """The endpoint's client half reading a unary body (after a JSON round trip, as a client gets it)."""
    answer = endpoint.client_answer()
    answer.unary(msgspec.json.decode(msgspec.json.encode(body)))
    return answer


# -- faults --------------------------------------------------------------------------------------------

class FaultySampler:
    """Wraps an engine's sampler so that sampling raises for the requests `fails` picks (a fault hook)."""

    def __init__(self, inner: Any, fails: Callable[[Any], bool]) -> None:
        self.inner, self.fails = inner, fails

    def sample_row(self, row: Any, request: Any) -> SampledToken:
        if self.fails(request):
            raise OverflowError("injected sampling fault")
        return self.inner.sample_row(row, request)

    def sample(self, logits: Any, requests: list[Any]) -> list[SampledToken]:
        return [self.sample_row(logits[i], r) for i, r in enumerate(requests)]


def advance(scheduler, batch) -> None:
    """What the runner and the engine would do with a scheduled batch, without a model: every chunk's tokens
    computed, token 7 sampled where a chunk samples, requests at their max_tokens removed; then the audit."""
    for chunk in batch.chunks:
        chunk.request.num_computed_tokens = chunk.end
        if chunk.samples:
            chunk.request.output_token_ids.append(7)
            if chunk.request.num_output_tokens >= chunk.request.sampling_params.max_tokens:
                scheduler.remove(chunk.request)
    scheduler.audit()


def reap(process, timeout: float = 30.0) -> None:
    """A child process of a test, ended: killed if still running, then collected with its pipes drained and closed."""
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=timeout)
