"""Virtual time: what a step would cost on a real model, from a simple cost model."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.batch import SchedulerOutput


@dataclass(frozen=True)
class CostModel:
    """Seconds per step: a fixed overhead, a cost per computed token, a cost per sequence."""

    step_overhead_s: float = 0.004
    per_token_s: float = 0.0004  # prefill and recompute: every computed position
    per_sequence_s: float = 0.0006  # reading a sequence's KV, sampling its row

    def step_seconds(self, batch: SchedulerOutput) -> float:
        return self.step_overhead_s + self.per_token_s * batch.num_batched_tokens + self.per_sequence_s * len(batch.chunks)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def advance_by(self, seconds: float) -> None:
        self.now += seconds


class TimedRunner:
    """Wraps a runner so that each forward advances the virtual clock by its modelled cost."""

    def __init__(self, runner, clock: VirtualClock, cost: CostModel) -> None:
        self.runner = runner
        self.clock = clock
        self.cost = cost
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple

    def execute(self, batch: SchedulerOutput):
        self.clock.advance_by(self.cost.step_seconds(batch))
        return self.runner.execute(batch)

    def load_adapter(self, name: str, path: str, max_rank: int):
        return self.runner.load_adapter(name, path, max_rank)

    def prepare_adapter(self, name: str, path: str, max_rank: int):
        return self.runner.prepare_adapter(name, path, max_rank)

    def install_adapter(self, prepared):
        return self.runner.install_adapter(prepared)

    def unload_adapter(self, name: str) -> None:
        self.runner.unload_adapter(name)
