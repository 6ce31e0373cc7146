"""The engine step loop: schedule, run the model, sample, update, report.

The engine is single-threaded: whoever owns it calls `add_request`, `abort`
and `step` from one thread (the async server puts it on its own thread).
`prepare_adapter` alone may run on any thread: it reads and builds a LoRA
adapter without touching the engine, for `install_adapter` to serve.

A runner that serves LoRA adapters has `prepare_adapter(name, path, max_rank)`
(thread-safe: a `PreparedAdapter`), `install_adapter(prepared)` and
`unload_adapter(name)` (core/adapters.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagoda.core import speculative
from pagoda.core.adapters import AdapterError, AdapterInfo, AdapterTable, PreparedAdapter
from pagoda.core.batch import ModelRunner, RunnerLost, ScheduledChunk, SchedulerOutput
from pagoda.core.constraint import Constraint, ConstraintError
from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.grammar import CompileQueue, Grammars
from pagoda.core.outputs import AnswerDelta, SampledToken
from pagoda.core.request import FinishReason, Request, RequestStatus
from pagoda.core.sampler import Sampler, StepLogits, score_row
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduling import SchedulingPolicy, make_policy

logger = logging.getLogger("pagoda.engine")
_COMPILE_WAIT_S = 0.05  # how long an idle step waits for a compiling grammar before returning


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
        policies: Mapping[str, Callable[[], SchedulingPolicy]] | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.clock = clock  # arrival and the queue/prefill/decode stamps (the simulator's is virtual)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # config.scheduling_policy looked up in `policies` (the plugins'; None: the built-in ones)
        policy = make_policy(config.scheduling_policy, policies)
        self.scheduler = Scheduler(config, self.block_manager, runner.row_multiple, policy=policy)
        self.speculation = self.scheduler.speculation  # what runs: the setting and the runner's row multiple
        self.sampler = Sampler()
        self.counters = EngineCounters()
        self.spec_counters = speculative.SpecCounters()
        self.requests: dict[str, Request] = {}  # live requests by id
        self.adapters = AdapterTable()  # the runner's loaded LoRA adapters and their live requests (core/adapters.py)
        self._pending_aborts: list[str] = []
        self._to_unload: list[str] = []  # adapters whose last request ended this step: unloaded at its end
        # Constrained decoding (core/grammar.py): grammars compile on a worker pool over the tokenizer's
        # vocabulary, sized to the LM head; a request waits in `compiling` until its grammar is ready.
        self.grammars = (Grammars(tokenizer.token_vocab, runner.vocab_size, sorted(self.eos_token_ids))
                         if hasattr(tokenizer, "token_vocab") else None)
        self.compiling = CompileQueue()

    # -- requests in and out -------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float | None = None,
        *, cache_salt: str | None = None, tenant: str | None = None, priority: int = 0, weight: float = 1.0,
        adapter: str | None = None,
    ) -> Request:
        """Queue a request; raises AdmissionError (or ValueError) for one that can never be served.

        `adapter`: a loaded LoRA adapter whose deltas its rows add (UnknownAdapter for another name).
        Cached prefix blocks are shared only between requests with equal `cache_salt`, `tenant` and `adapter` (the
        same load of it: core/adapters.py).
        `priority` (lower runs first) and `weight` (its tenant's share) are read by the scheduling policy.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already live")
        self._check_token_ids(prompt_token_ids, sampling_params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < float("inf"):
            raise ValueError(f"weight must be a positive number, got {weight!r}")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if adapter is not None:
            self.adapters.check(adapter)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            tenant=tenant,
            priority=priority,
            weight=weight,
            adapter=adapter,
            adapter_key=None if adapter is None else self.adapters.keys[adapter],
        )
        if sampling_params.prompt_logprobs is not None:  # the first prompt token has nothing before it to score it
            request.prompt_logprobs = [SampledToken(prompt_token_ids[0])] + [None] * (request.num_prompt_tokens - 1)
        self._admit(request)
        self.adapters.acquire(adapter)  # released when it ends (_finish)
        if self.tokenizer is not None:
            request.text_stream = self.tokenizer.text_stream(sampling_params.stop)
        self.requests[request_id] = request
        self.counters.requests_total += 1
        self.counters.prompt_tokens_total += request.num_prompt_tokens
        return request

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # Token ids are checked against this model's vocabulary, which SamplingParams cannot know.
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.vocab_size
        for field, ids in (("prompt", prompt_token_ids), ("logit_bias", params.logit_bias),
                           ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
            if bad is not None:
                raise ValueError(f"{field} token id {bad!r} is outside the vocabulary (0..{vocab - 1})")

    def _admit(self, request: Request) -> None:
        """Into the scheduler; a constrained request waits in `compiling` until its grammar is ready."""
        constraint = request.sampling_params.constraint
        if constraint is None:
            self.scheduler.add(request)
            return
        self.scheduler.check_admissible(request)
        future = self.compile_constraint(constraint)
        if not future.done():
            self.compiling.hold(request, future)
            return
        request.grammar = self.grammars.matcher(future.result(), constraint.field)  # raises the compile's error
        self.scheduler.add(request)

    def compile_constraint(self, constraint: Constraint) -> Future[Any]:
        """Start compiling (or find compiled) a constraint; thread-safe, so a caller can await it off the loop."""
        if self.grammars is None:
            raise ValueError(f"{constraint.field}: constrained output needs a tokenizer; this engine has none")
        return self.grammars.submit(constraint)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load a LoRA adapter that requests may then name (AdapterError, naming the field, when it is refused)."""
        return self.install_adapter(self.prepare_adapter(name, path))

    def prepare_adapter(self, name: str, path: str) -> PreparedAdapter:
        """Read, check and build a LoRA adapter for `install_adapter` (AdapterError, naming the field, when it is
        refused). It touches nothing of the engine's, so it may run on any thread while the engine steps."""
        if name in self.adapters.snapshot:  # a quick refusal (the snapshot is safe to read anywhere); install checks
            raise AdapterError(f"LoRA adapter {name!r} is already loaded", "lora_name")
        prepare = getattr(self.runner, "prepare_adapter", None)
        if prepare is None:
            raise AdapterError("this engine's model runner serves no LoRA adapters", "lora_path")
        return prepare(name, path, self.config.max_lora_rank)

    def install_adapter(self, prepared: PreparedAdapter) -> AdapterInfo:
        """Serve a prepared adapter: requests may name it from now on (AdapterError, naming lora_name, when its name
        was loaded meanwhile, or is still being unloaded)."""
        name = prepared.info.name
        if name in self.adapters.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded", "lora_name")
        info = self.runner.install_adapter(prepared)
        self.adapters.add(info)
        logger.info("LoRA adapter %r loaded from %s: rank %d, %s, %.1f MiB", name, info.path, info.rank,
                    "+".join(info.target_modules), info.nbytes / 2**20)
        return info

    def unload_adapter(self, name: str) -> Future[AdapterInfo]:
        """Unload an adapter (UnknownAdapter when none is loaded by that name). New requests may no longer name it
        at once; it is freed when its last live request ends (at once when none is live), which the future says:
        the adapter's info, or the runner's error when its unload failed."""
        future, now = self.adapters.begin_unload(name)
        if now:
            self._unload(name)
        return future

    def _unload_released(self) -> None:
        """The step's last phase: unload the adapters being unloaded whose last request ended in this step."""
        pending, self._to_unload = self._to_unload, []
        for name in pending:
            self._unload(name)

    def _unload(self, name: str) -> None:
        """The runner frees the adapter and the table forgets it, even when the runner fails: its waiters then
        hear the runner's error. A RunnerLost (no step can run again) is raised on once they have heard it."""
        try:
            self.runner.unload_adapter(name)
        except BaseException as exc:
            self.adapters.remove(name, exc)
            if isinstance(exc, RunnerLost) or not isinstance(exc, Exception):
                raise
            logger.exception("unloading LoRA adapter %r failed; it is forgotten all the same", name)
            return
        self.adapters.remove(name)
        logger.info("LoRA adapter %r unloaded", name)

    def abort(self, request_id: str) -> None:
        """Mark a request to be aborted at the top of the next step; unknown ids are a no-op."""
        self._pending_aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_aborts)

    def anticipation(self) -> float:
        """Seconds whoever drives the engine should wait for a new request before the next step, as the scheduling
        policy asks (fair: for a tenant whose request just ended and who came back promptly before; fcfs: 0).
        An arrival ends the wait; waiting never changes an answer, only when it is computed."""
        return self.scheduler.anticipation() if not self._pending_aborts else 0.0

    # -- the step ------------------------------------------------------
    def step(self) -> list[AnswerDelta]:
        """One engine iteration; returns the outputs of every request that progressed or ended."""
        outputs = self._apply_aborts() + self._admit_compiled()
        outputs += self._forward()
        self._unload_released()  # after every way a request may have ended in this step
        return outputs

    def _forward(self) -> list[AnswerDelta]:
        """Schedule, run, advance the computed counts, collect."""
        started = self.clock()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.compiling.wait(_COMPILE_WAIT_S)  # nothing to run: rather than spin, wait for a grammar
            return []
        self.counters.steps_total += 1
        try:
            logits = self.runner.execute(batch).logits
        except RunnerLost:
            raise  # no step can run again: whoever owns the engine ends every request (core/async_engine.py)
        except Exception as exc:  # one failed forward must not take the server down
            return self._fail(batch, exc)
        self._advance(batch, started)
        return self._collect(batch, logits)

    def run(self) -> Iterator[AnswerDelta]:
        """Step until every request has finished (offline use)."""
        while self.has_unfinished():
            yield from self.step()

    def _admit_compiled(self) -> list[AnswerDelta]:
        # requests whose grammar has compiled enter the scheduler; a failed compile ends its request alone
        outputs = [self._fail_request(request, exc) for request, exc in self.compiling.failures()]
        for request, compiled in self.compiling.ready():
            try:
                request.grammar = self.grammars.matcher(compiled, request.sampling_params.constraint.field)
                self.scheduler.add(request)
                self.compiling.discard(request)
            except Exception as exc:
                outputs.append(self._fail_request(request, exc))
        return outputs

    def _advance(self, batch: SchedulerOutput, started: float) -> None:
        # the step's KV is in the cache now: every chunk's tokens count as computed
        for chunk in batch.chunks:
            chunk.request.num_computed_tokens = chunk.end
            chunk.request.scheduled_time = chunk.request.scheduled_time or started

    def _collect(self, batch: SchedulerOutput, logits: Any) -> list[AnswerDelta]:
        # logits: [rows, V]: per chunk, its prompt rows (prompt logprobs), then, when it reaches its request's end,
        # its last token's row and one per draft (core/batch.py). A failure in one request's own work (its
        # sampling, logits processing, detokenizing) fails it alone.
        # the rows come off a GPU with one wait for the whole step, not one per row (core/sampler.py)
        chunks = batch.logits_chunks
        step = StepLogits(logits, [r for c in chunks for r in [None] * c.num_prompt_rows
                                   + [c.request] * (c.num_logits_rows - c.num_prompt_rows)])
        outputs, row = [], 0
        for chunk in chunks:
            prompt_end, row_end = row + chunk.num_prompt_rows, row + chunk.num_logits_rows
            try:
                self._score_prompt(chunk, step, range(row, prompt_end))
                if chunk.samples:
                    outputs.append(self._take(chunk, step, range(prompt_end, row_end)))
            except Exception as exc:
                logger.exception("request %s failed in sampling; failing it alone", chunk.request.request_id)
                outputs.append(self._fail_request(chunk.request, exc))
            row = row_end
        return outputs

    def _score_prompt(self, chunk: ScheduledChunk, step: StepLogits, rows: range) -> None:
        """Prompt logprobs: the row at position p scores prompt token p + 1 (a recomputed row scores it again,
        with the same bits: a row's logits do not depend on the batch)."""
        request = chunk.request
        k, prompt = request.sampling_params.prompt_logprobs, request.prompt_token_ids
        for position, i in enumerate(rows, start=chunk.start):
            request.prompt_logprobs[position + 1] = score_row(step.row(i), prompt[position + 1], k)

    def _take(self, chunk: ScheduledChunk, step: StepLogits, rows: range) -> AnswerDelta:
        """Sample the chunk's rows (1 + drafts of the step's logits) in order, keeping its drafts while they equal
        the token sampled.

        Each token is appended (penalties and stop checks then see exactly the plain decode's tokens) before the
        next row is sampled; a draft equal to the token sampled at its place is computed KV, which this phase
        alone counts (core/speculative.py). The token after the last kept draft comes free."""
        request, tokens, text = chunk.request, [], ""
        prompt_logprobs = request.prompt_logprobs if request.scores_prompt else None  # with the first output
        if request.sampling_params.max_tokens == 0:  # the prompt scored, nothing to generate
            text = self._finish(request, FinishReason.LENGTH)
            return AnswerDelta.of(request, [], text, prompt_logprobs=prompt_logprobs)
        drafts = chunk.draft_token_ids
        for j, i in enumerate(rows):
            token_id = step.greedy[i]  # decided on the GPU for a plain greedy row, else sampled here
            token = SampledToken(token_id) if token_id is not None else self.sampler.sample_row(step.row(i), request)
            tokens.append(token)
            text += self._append(request, token)
            if request.is_finished or j == len(drafts) or token.token_id != drafts[j]:
                break
            request.num_computed_tokens += 1  # draft j's KV, written this step, is that of the token just appended
        if self.spec_counters.count(chunk, tokens) and not request.is_finished:
            self.scheduler.trim(request)  # the blocks only its rejected drafts used return
        logprobs = tokens if request.sampling_params.logprobs is not None else []
        return AnswerDelta.of(request, [t.token_id for t in tokens], text, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)

    def _append(self, request: Request, token: SampledToken) -> str:
        """Append one sampled token and return its text; finishes the request if it stops here."""
        request.output_token_ids.append(token.token_id)
        request.first_token_time = request.first_token_time or self.clock()
        self.counters.generated_tokens_total += 1
        text = request.text_stream.push(token.token_id) if request.text_stream else ""
        reason = self._finish_reason(request, token.token_id)
        return text + self._finish(request, reason) if reason is not None else text

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
        if request.grammar is not None and request.grammar.is_terminated:  # its grammar has ended
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> str:
        """Take the request out of the scheduler (its blocks return now); returns held-back text."""
        if self.compiling.discard(request):  # its grammar was still compiling: it is in no scheduler queue
            request.status = RequestStatus.FINISHED
        else:
            self.scheduler.remove(request)
        del self.requests[request.request_id]
        if (unload := self.adapters.release(request.adapter)) is not None:  # the last user of one being unloaded:
            self._to_unload.append(unload)  # unloaded at the end of the step (_unload_released), not in its phase
        request.finished_time = self.clock()
        request.finish_reason = reason
        stream = request.text_stream
        if stream is not None and stream.stopped is None and reason is not FinishReason.ABORT:
            return stream.flush()
        return ""

    def _apply_aborts(self) -> list[AnswerDelta]:
        outputs = []
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            self.counters.aborted_total += 1
            outputs.append(AnswerDelta.of(request, [], ""))
        return outputs

    def _fail(self, batch: SchedulerOutput, exc: Exception) -> list[AnswerDelta]:
        # A forward that raises cannot say which row caused it: the whole batch ends with an error
        # (each stream gets its protocol's error event), never a silently truncated answer.
        logger.exception("model step failed; failing %d request(s)", len(batch.chunks))
        return [self._fail_request(chunk.request, exc) for chunk in batch.chunks]

    def _fail_request(self, request: Request, exc: Exception) -> AnswerDelta:
        """End one request with finish reason error (its blocks return now); its output carries the error."""
        if request.request_id in self.requests:  # it may have finished just before its own work raised
            self._finish(request, FinishReason.ERROR)
        request.finish_reason = FinishReason.ERROR
        self.counters.failed_total += 1
        # a constraint the vocabulary cannot follow is the request's to fix: its output names the field
        field = exc.field if isinstance(exc, ConstraintError) else None
        return AnswerDelta.of(request, [], "", error=f"{type(exc).__name__}: {exc}", error_field=field)

    def close(self) -> None:
        """End what the runner holds beyond this process (a tensor-parallel group's ranks); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

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
            "kv_block_size": pool.block_size,
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
            **self.spec_counters.stats(),
            **self.adapters.stats(),
        }

    def describe(self) -> dict[str, Any]:
        """What /health says of how the engine runs, beyond its counters (a tensor-parallel group)."""
        describe = getattr(self.runner, "describe", None)
        return describe() if describe is not None else {}
