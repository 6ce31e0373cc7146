"""The engine step loop: schedule, run the model, sample, update, report.

The engine is single-threaded: whoever owns it calls `add_request`, `abort`
and `step` from one thread (the async server puts it on its own thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagoda.core.batch import ModelRunner, SchedulerOutput
from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.outputs import RequestOutput, RequestTimes, SampledToken
from pagoda.core.request import FinishReason, Request
from pagoda.core.sampler import Sampler
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler

logger = logging.getLogger("pagoda.engine")


@dataclass
class EngineCounters:
    """Monotonic counters; running/waiting/pool numbers are read live from the scheduler."""

    requests_total: int = 0
    aborted_total: int = 0
    failed_total: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    steps_total: int = 0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.clock = clock  # arrival and the queue/prefill/decode stamps (the simulator's is virtual)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.counters = EngineCounters()
        self.requests: dict[str, Request] = {}  # live requests by id
        self._pending_aborts: list[str] = []

    # -- requests in and out -------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float | None = None,
        *, cache_salt: str | None = None, tenant: str | None = None,
    ) -> Request:
        """Queue a request; raises AdmissionError (or ValueError) for one that can never be served.

        Cached prefix blocks are shared only between requests with equal `cache_salt` and `tenant`.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already live")
        self._check_prompt(prompt_token_ids)
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            tenant=tenant,
        )
        self.scheduler.add(request)
        if self.tokenizer is not None:
            request.text_stream = self.tokenizer.text_stream(sampling_params.stop)
        self.requests[request_id] = request
        self.counters.requests_total += 1
        self.counters.prompt_tokens_total += request.num_prompt_tokens
        return request

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})")

    def abort(self, request_id: str) -> None:
        """Mark a request to be aborted at the top of the next step; unknown ids are a no-op."""
        self._pending_aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_aborts)

    # -- the step ------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of every request that progressed or ended."""
        outputs = self._apply_aborts()
        started = self.clock()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        self.counters.steps_total += 1
        try:
            sampled = self._sample(batch, self.runner.execute(batch).logits)
        except Exception as exc:  # one failed forward must not take the server down
            return outputs + self._fail(batch, exc)
        self._advance(batch, started)
        return outputs + self._collect(batch, sampled)

    def run(self) -> Iterator[RequestOutput]:
        """Step until every request has finished (offline use)."""
        while self.has_unfinished():
            yield from self.step()

    def _sample(self, batch: SchedulerOutput, logits: Any) -> list[SampledToken]:
        # logits: [len(batch.sample_chunks), V], one row per chunk that reaches its request's end
        sample_chunks = batch.sample_chunks
        return self.sampler.sample(logits, [c.request for c in sample_chunks]) if sample_chunks else []

    def _advance(self, batch: SchedulerOutput, started: float) -> None:
        # the step's KV is in the cache now: every chunk's tokens count as computed
        for chunk in batch.chunks:
            chunk.request.num_computed_tokens = chunk.end
            chunk.request.scheduled_time = chunk.request.scheduled_time or started

    def _collect(self, batch: SchedulerOutput, sampled: list[SampledToken]) -> list[RequestOutput]:
        # append each sampled token, stream its text, and finish the requests that stop here
        outputs = []
        for chunk, token in zip(batch.sample_chunks, sampled):
            request = chunk.request
            request.output_token_ids.append(token.token_id)
            request.first_token_time = request.first_token_time or self.clock()
            self.counters.generated_tokens_total += 1
            text = request.text_stream.push(token.token_id) if request.text_stream else ""
            reason = self._finish_reason(request, token.token_id)
            if reason is not None:
                text += self._finish(request, reason)
            logprobs = [token] if request.sampling_params.logprobs is not None else []
            outputs.append(self._output(request, [token.token_id], text, logprobs=logprobs))
        return outputs

    def _finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if request.text_stream is not None and request.text_stream.stopped is not None:
            request.stop_reason = request.text_stream.stopped
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return FinishReason.STOP
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> str:
        """Take the request out of the scheduler (its blocks return now); returns held-back text."""
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        request.finished_time = self.clock()
        request.finish_reason = reason
        stream = request.text_stream
        if stream is not None and stream.stopped is None and reason is not FinishReason.ABORT:
            return stream.flush()
        return ""

    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            self.counters.aborted_total += 1
            outputs.append(self._output(request, [], ""))
        return outputs

    def _fail(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.exception("model step failed; failing %d request(s)", len(batch.chunks))
        outputs = []
        for chunk in batch.chunks:
            request = chunk.request
            self._finish(request, FinishReason.ERROR)
            self.counters.failed_total += 1
            outputs.append(self._output(request, [], "", error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _output(self, request: Request, token_ids: list[int], text: str, **extra: Any) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            stop_reason=request.stop_reason,
            times=RequestTimes(request.arrival_time, request.scheduled_time, request.first_token_time,
                               request.finished_time) if request.is_finished else None,
            num_cached_tokens=request.num_cached_tokens,
            **extra,
        )

    # -- what the outside may ask --------------------------------------
    def audit(self) -> None:
        """The ledger audit (raises AuditError); call between steps."""
        self.scheduler.audit()

    def stats(self) -> dict[str, int]:
        """The numbers /health reports."""
        scheduler, pool, c = self.scheduler, self.block_manager, self.counters
        return {
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_blocks_cached_free": pool.num_cached_free_blocks,
            "preemptions_total": scheduler.num_preemptions,
            "recomputed_tokens_total": scheduler.num_recomputed_tokens,
            "aborted_total": c.aborted_total,
            "failed_total": c.failed_total,
            "generated_tokens_total": c.generated_tokens_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "requests_total": c.requests_total,
            "peak_running": scheduler.peak_running,
            "prefix_cache_queried_tokens_total": scheduler.num_prefix_queried_tokens,
            "prefix_cache_hit_tokens_total": scheduler.num_prefix_hit_tokens,
            "steps_total": c.steps_total,
        }
