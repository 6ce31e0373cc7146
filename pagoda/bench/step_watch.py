"""Instruments a benchmark puts on a live engine: how its steps' time splits, and what its steps sampled.

- `step_split(engine, parts)`: while it is open, each step's time split into the forward (to the device's end),
  sampling and host work, as means over the steps that ran the model and over the decode-only ones.
- `GraphCheck`: one run's tokens and every step's sampled logits rows, to compare two runs of the same prompts
  bitwise (CUDA graphs against eager steps, pagoda bench offline --compare-cuda-graphs).

Both wrap methods with instance attributes, so the engine's own code is what runs and is timed.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pagoda.core.engine import Engine


@contextmanager
def step_split(engine: Engine, parts: dict[str, float]) -> Iterator[None]:
    """Fill `parts` with the mean ms per step of the forward, sampling and host work, over every step that ran
    the model and (prefixed `decode_`) over the decode-only ones.

    The forward is the runner's execute less its input preparation, to the device's end (synchronized there);
    sampling is the engine's collection of the step's tokens; host is the rest of the step (scheduling, input
    preparation, bookkeeping). Instance attributes wrap the methods and are removed after."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    runner = engine.runner
    step, execute, prepare, collect = engine.step, runner.execute, runner.prepare, engine._collect
    fill_graph = runner.fill_graph  # a CUDA graph step's input preparation (pagoda/model/cuda_graphs.py)
    current: collections.Counter = collections.Counter()  # this step's parts, in seconds
    totals: collections.Counter = collections.Counter()

    def timed(part, fn, end=lambda: None):
        def run(*args):
            start = time.perf_counter()
            try:
                out = fn(*args)
                end()
                return out
            finally:
                current[part] += time.perf_counter() - start
        return run

    def timed_step():
        current.clear()
        start = time.perf_counter()
        try:
            return step()
        finally:
            wall = time.perf_counter() - start
            if current["execute"]:  # a step that ran the model
                forward = current["execute"] - current["prepare"]
                for prefix in ("", "decode_") if current["decode_only"] else ("",):
                    totals[prefix + "steps"] += 1
                    totals[prefix + "forward"] += forward
                    totals[prefix + "sampling"] += current["sampling"]
                    totals[prefix + "host"] += wall - forward - current["sampling"]
                    totals[prefix + "wall"] += wall

    def execute_batch(batch):
        current["decode_only"] = all(c.num_tokens == 1 for c in batch.chunks)
        return execute(batch)

    runner.prepare = timed("prepare", prepare)
    runner.fill_graph = timed("prepare", fill_graph)
    runner.execute = timed("execute", execute_batch, sync)
    engine._collect = timed("sampling", collect)
    engine.step = timed_step
    try:
        yield
    finally:
        for owner, attr in ((runner, "prepare"), (runner, "fill_graph"), (runner, "execute"), (engine, "_collect"),
                            (engine, "step")):
            delattr(owner, attr)  # the instance attribute goes; the class's method is back
        for prefix in ("", "decode_"):
            if n := totals[prefix + "steps"]:
                parts[prefix + "steps"] = n
                for part in ("forward", "sampling", "host", "wall"):
                    parts[f"{prefix}{part}_ms"] = 1e3 * totals[prefix + part] / n


class GraphCheck:
    """One engine run's tokens and every step's sampled logits rows (kept on the device, a copy per step: the same
    small cost with and without CUDA graphs), to compare two runs bitwise after both."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logits: list[torch.Tensor] = []  # per step that sampled: float32 [rows, V]

    def watch(self, engine: Engine) -> None:
        """Keep the logits of each step the runner runs from now on (an instance attribute wraps its run)."""
        runner = engine.runner
        run = runner.run

        def run_and_keep(plan):
            logits = run(plan)
            if logits is not None:
                self.logits.append(logits.clone())
            return logits

        runner.run = run_and_keep

    def compare(self, other: GraphCheck) -> dict:
        """Tokens equal, and how many logits rows are bitwise equal, step by step."""
        rows = rows_equal = 0
        max_diff = 0.0
        steps_equal = len(self.logits) == len(other.logits)
        for mine, theirs in zip(self.logits, other.logits):
            if mine.shape != theirs.shape:
                steps_equal = False
                continue
            rows += mine.shape[0]
            rows_equal += int((mine == theirs).all(dim=1).sum())
            if mine.numel():
                max_diff = max(max_diff, float((mine - theirs).abs().max()))
        tokens_equal = self.tokens == other.tokens
        return {"tokens_equal": tokens_equal, "logits_rows_equal": rows_equal, "logits_rows": rows,
                "steps_equal": steps_equal, "max_abs_logit_difference": max_diff,
                "ok": tokens_equal and steps_equal and rows_equal == rows}
