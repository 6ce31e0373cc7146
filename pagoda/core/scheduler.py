"""Continuous batching with chunked prefill and preemption by recompute.

Design note. There is no prefill phase and no decode phase: every request has
tokens (prompt + output so far) and a count of them whose KV is cached. Each
step hands out a budget of `max_batched_tokens` new tokens, first to running
requests in arrival order (a decode costs one token, an unfinished prefill
takes what is left of the budget), then to waiting requests while a running
slot and blocks are free. A long prompt is thus prefilled over several steps.

When a running request cannot get the block it needs, the newest running
request is preempted: its blocks are freed, its cached-token count drops to
zero and it goes to the front of the waiting queue. When it runs again it
recomputes prompt + output so far in prefill chunks, and because sampling
state lives on the request, its continuation is unchanged.

Prefix caching. A waiting request is admitted by its uncached tokens: its
leading blocks already in the cache (`BlockManager.cached_prefix`) are taken,
not computed, so its first chunk starts after them and the budget and the
KV-block check count only what must be computed and newly taken. At least its
last token is computed, for the logits to sample from. Full blocks join the
cache once their KV is written: at the top of the next `schedule()`, or when
their request is preempted or leaves.

Requests that could never fit (more KV slots than the whole pool, or longer
than the model's context) are refused when they are added, never left waiting.

Speculation. Once the step's chunks are chosen, greedy sampling chunks get
n-gram drafts (core/speculative.py) in the rows the runner would pad anyway
(its `row_multiple`, for token rows and for LM-head rows alike), plus the
extra rows the setting allows (none by default, so a step never grows); their
slots are allocated like any tokens, and a draft never preempts or waits for
a block. `self.speculation` is what the setting and the runner leave running.

LoRA adapters. A request may add an adapter's deltas to its rows (`Request.adapter`); at most
`max_loras` distinct adapters run at once. When the request the policy chose could run but for
its adapter being one too many, no other adapter request is admitted past it in that step, while
base requests (they take no adapter slot) still are, in the policy's order and under the same
budget, block and slot checks (the policy picks from a view of the waiting queue holding only
them). It is never starved: the running adapters' requests end in bounded time and none joins
them, so its adapter gets its place; and once its adapter fits, a request short of blocks or a
slot stops admission as any does.

Policy. The order of admission, each request's share of the step's budget and the
choice of whom to preempt are asked of a SchedulingPolicy (core/scheduling.py);
the default, fcfs, is the schedule described above. A policy may also preempt
running requests so that waiting ones it prefers can run (`rebalance`); those
are preempted before the running requests are scheduled, and unlike a preemption
for blocks they do not stop admission in that step. And it may ask whoever drives
the engine to wait a moment for an arrival before the next schedule
(`anticipation`: fair's wait for a tenant about to come back).
No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pagoda.core import speculative
from pagoda.core.batch import ScheduledChunk, SchedulerOutput
from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduling import SchedulingPolicy


class AdmissionError(ValueError):
    """A request that can never be served under this configuration."""


class KVCacheExhausted(AdmissionError):
    """The request needs more KV slots than the whole pool holds."""


class ContextLengthExceeded(AdmissionError):
    """Prompt + max_tokens is longer than the model's context; `field` names the one to shorten."""

    def __init__(self, message: str, field: str = "max_tokens") -> None:
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    """The waiting queue holds `max_waiting` requests: a new one is refused now (it may be retried later)."""


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, row_multiple: int = 1,
                 policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.policy = policy if policy is not None else SchedulingPolicy()  # fcfs
        self.row_multiple = row_multiple  # the runner's: drafts go into the rows it pads with
        self.speculation = speculative.in_force(config.speculative, row_multiple)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.peak_running = 0
        self.num_prefix_queried_tokens = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of which found there

    # -- admission -----------------------------------------------------
    def check_admissible(self, request: Request) -> None:
        """Raise AdmissionError when the request can never be served; the message gives the numbers."""
        total = request.num_prompt_tokens + request.sampling_params.max_tokens
        if total > self.config.max_model_len:
            raise ContextLengthExceeded(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.sampling_params.max_tokens})"
                f" = {total} exceeds the model's context of {self.config.max_model_len} tokens",
                "prompt" if request.num_prompt_tokens >= self.config.max_model_len else "max_tokens",
            )
        need = self.block_manager.blocks_for(request.max_kv_tokens)
        if need > self.block_manager.num_blocks:
            raise KVCacheExhausted(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.sampling_params.max_tokens})"
                f" needs {need} KV blocks of {self.block_manager.block_size} tokens,"
                f" but the whole pool has {self.block_manager.num_blocks}"
            )

    def add(self, request: Request) -> None:
        self.check_admissible(request)
        limit = self.config.max_waiting
        if limit is not None and len(self.waiting) >= limit:  # preempted requests re-enter without this check
            raise QueueFull(f"the server is busy: {len(self.waiting)} requests are already waiting (max {limit})")
        request.status = RequestStatus.WAITING
        self.policy.enqueue(self.waiting, request)

    # -- one step ------------------------------------------------------
    def anticipation(self) -> float:
        """Seconds the policy asks to wait for an arrival before the next schedule (fcfs: 0)."""
        return self.policy.anticipation(self.running, self.waiting)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks: running requests first, then waiting ones."""
        budget = self.config.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        for request in self.running:  # the blocks the last step computed join the cache
            self.block_manager.cache_blocks(request)
        self.policy.start_step(self.running, self.waiting, budget, self.config.max_running)
        rebalanced = self.policy.rebalance(self.running, self.waiting, self.config.max_running)  # fcfs: none
        for victim in rebalanced:
            self._preempt(victim)
        budget = self._schedule_running(budget, chunks, preempted)
        if not preempted:  # admitting new work while evicting for blocks would only thrash
            budget = self._schedule_waiting(budget, chunks)
        if rebalanced:
            preempted = [v.request_id for v in rebalanced] + preempted
        self._add_drafts(chunks, budget)
        self.peak_running = max(self.peak_running, len(self.running))
        assert len(self.running) <= self.config.max_running
        assert sum(c.num_rows for c in chunks) <= self.config.max_batched_tokens
        assert len({c.request.adapter for c in chunks} - {None}) <= self.config.max_loras
        return SchedulerOutput(chunks=chunks, block_size=self.block_manager.block_size, preempted_ids=preempted)

    def _schedule_running(self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]) -> int:
        i, policy = 0, self.policy
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = policy.grant(request, request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:  # its share of this step is spent: it waits, keeping its blocks
                i += 1
                continue
            end = request.num_computed_tokens + num_new
            while not self.block_manager.can_allocate(request.request_id, end):
                victim = policy.victim(self.running[i:], self.running)  # fcfs: the newest
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        bm, policy = self.block_manager, self.policy
        candidates = self.waiting  # what the policy picks from: the waiting queue, or only its base requests (below)
        while candidates and budget > 0 and len(self.running) < self.config.max_running:
            request = policy.next_waiting(candidates, self.running)  # fcfs: the head of the queue
            if request is None or (candidates is not self.waiting and request.adapter is not None):
                break  # (or, past a request its adapter held back, a policy that picked beyond the base requests)
            assert request.num_computed_tokens == 0, f"waiting request {request.request_id!r} has computed tokens"
            # never covers the last token: num_new >= 1. A request scoring its prompt computes every position: the
            # cache holds KV, not the logits its prompt logprobs need.
            hits = bm.cached_prefix(request) if not request.scores_prompt else []
            num_cached = len(hits) * bm.block_size
            num_new = policy.grant(request, request.num_tokens - num_cached, budget)
            if num_new == 0:  # no tokens for it this step: admitting it would run a chunk of nothing
                break
            if not bm.can_allocate(request.request_id, num_cached + num_new, hits):
                break  # nobody overtakes the request the policy chose (fcfs: the head of the queue)
            if not self._adapter_fits(request):
                # only its adapter holds it back: base requests may come in past it, no adapter request may
                candidates = deque(r for r in self.waiting if r.adapter is None)
                continue
            _take(self.waiting, request)
            if candidates is not self.waiting:
                _take(candidates, request)
            self._count_prefix_hit(request, num_cached)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new, hits))
            budget -= num_new
        return budget

    def _adapter_fits(self, request: Request) -> bool:
        """Whether running `request` keeps the running requests' distinct LoRA adapters within `max_loras`.

        Every step's chunks are running requests', so this bounds each step. A request that does not fit stops
        the admission of adapter requests (base requests still come in): the running adapters' requests end in
        bounded time and none joins them meanwhile, so the waiting request's adapter gets its place."""
        if request.adapter is None:
            return True
        running = {r.adapter for r in self.running if r.adapter is not None}
        return request.adapter in running or len(running) < self.config.max_loras

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Give greedy sampling chunks drafts, in arrival order, as long as the spare rows last."""
        spec, bm = self.speculation.config, self.block_manager
        if spec is None:
            return
        sampling = [c for c in chunks if c.samples]
        spare = min(speculative.num_spare_rows(sum(c.num_tokens for c in chunks), self.row_multiple, spec.max_extra_rows),
                    speculative.num_spare_rows(len(sampling), self.row_multiple, spec.max_extra_rows), budget)
        for chunk in sampling:
            if spare <= 0:
                return
            drafts = speculative.drafts_for(chunk.request, spec, spare, self.config.max_model_len)
            if not drafts or not bm.can_allocate(chunk.request.request_id, chunk.end + len(drafts)):
                continue
            chunk.block_table = tuple(bm.allocate(chunk.request.request_id, chunk.end + len(drafts)))
            chunk.draft_token_ids = tuple(drafts)
            spare -= len(drafts)

    def trim(self, request: Request) -> None:
        """Return the blocks a request's rejected drafts took beyond its computed tokens."""
        self.block_manager.trim(request.request_id, request.num_computed_tokens)

    def _count_prefix_hit(self, request: Request, num_cached: int) -> None:
        if not self.block_manager.enable_prefix_caching or request.scores_prompt:  # not looked up
            return
        self.num_prefix_queried_tokens += request.num_tokens
        self.num_prefix_hit_tokens += num_cached
        if request.num_preemptions == 0:  # what usage reports: the first admission, not a resume
            request.num_cached_tokens = num_cached

    def _chunk(self, request: Request, num_new: int, hits: Sequence[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        table = self.block_manager.allocate(request.request_id, start + num_new, hits)
        # a scoring request's rows up to its prompt's last (whose logits sample) score the prompt token after each
        prompt_rows = min(start + num_new, request.num_prompt_tokens - 1) - start if request.scores_prompt else 0
        return ScheduledChunk(request=request, start=start, num_tokens=num_new, block_table=tuple(table),
                              num_prompt_rows=max(prompt_rows, 0))

    def _preempt(self, request: Request) -> None:
        _remove_identical(self.running, request)
        self.block_manager.cache_blocks(request)  # its computed blocks may serve its own resume
        self.block_manager.free(request.request_id)
        self.num_preemptions += 1
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_preemptions += 1
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.policy.requeue(self.waiting, request)

    # -- leaving -------------------------------------------------------
    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of its queue and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            _remove_identical(self.running, request)
            self.block_manager.cache_blocks(request)  # what its last step computed stays reusable
        elif request.status is RequestStatus.WAITING:
            _remove_identical(self.waiting, request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED

    def audit(self) -> None:
        """The ledger audit over the live requests (waiting requests hold no blocks)."""
        self.block_manager.audit(
            {r.request_id: r.num_computed_tokens for r in self.running},
            {r.request_id: r.all_token_ids for r in self.running},
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def _take(queue: deque[Request], request: Request) -> None:
    """Remove an admitted request from `queue`: its head, usually."""
    if queue[0] is request:
        queue.popleft()
    else:
        _remove_identical(queue, request)


def _remove_identical(queue: list[Request] | deque[Request], request: Request) -> None:
    """Remove `request` itself from `queue`, searching from the newest end.

    Not `queue.remove`: that calls the dataclass `__eq__` (a tuple of every field) on each request
    before it, which with thousands waiting was the scheduler's largest cost. A request that hangs up
    while waiting is usually among the newest, hence the search from the right.
    """
    for i, queued in enumerate(reversed(queue)):
        if queued is request:
            del queue[len(queue) - 1 - i]
            return
    raise ValueError(f"request {request.request_id!r} is not in its queue")
