"""The contract between the engine and whatever computes logits.

The real torch model and the simulator's fake model both implement
`ModelRunner`; the engine never knows which one it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.core.batch import SchedulerOutput


@dataclass(frozen=True)
class RunnerOutput:
    # float32 tensor [len(batch.sample_chunks), vocab_size]: the logits at the
    # last position of every chunk that samples, in `sample_chunks` order.
    logits: Any


class ModelRunner(Protocol):
    vocab_size: int

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Run one forward over the batch: write its new KV, return logits for the sampling chunks."""
        ...
