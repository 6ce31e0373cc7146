"""`pagoda bench scheduler`: what the scheduler and the block ledger cost per step.

16, 64, 256 and 1024 requests decode side by side (each step grows every table, so
blocks are allocated as positions cross block boundaries); the timed part is
`Scheduler.schedule()` plus the bookkeeping the engine does after a forward
(computed counts, appended tokens). No tensors are involved. A simulation
(`pagoda simulate`'s crowd, solo reruns included) is reported after it: the
whole `Engine.step()` with the fake model, per step.
"""

from __future__ import annotations

import time

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from pagoda.simulator.crowd import mixed_crowd
from pagoda.simulator.simulate import SimulationConfig, simulate


def _decoding_scheduler(num_running: int, prompt_len: int, block_size: int) -> Scheduler:
    config = EngineConfig(
        num_blocks=num_running * 64, block_size=block_size, max_running=num_running,
        max_batched_tokens=num_running * prompt_len, max_model_len=4096,
    )
    scheduler = Scheduler(config, BlockManager(config.num_blocks, block_size))
    params = SamplingParams(max_tokens=2048, temperature=0)
    for i in range(num_running):
        scheduler.add(Request(f"r{i}", list(range(1, prompt_len + 1)), params))
    _commit(scheduler.schedule())  # the prefill step
    return scheduler


def _commit(batch) -> None:
    for chunk in batch.chunks:
        chunk.request.num_computed_tokens = chunk.end
    for chunk in batch.sample_chunks:
        chunk.request.output_token_ids.append(1)


def scheduler_step_cost(num_running: int = 256, steps: int = 500, prompt_len: int = 32, block_size: int = 16) -> dict:
    """Mean and worst seconds per decode step of schedule() + commit with `num_running` running.

    Wall time, and this process's CPU time beside it: on a shared machine a step longer than a
    time slice waits for other processes' slices, which the wall time counts and the CPU time does not.
    """
    scheduler = _decoding_scheduler(num_running, prompt_len, block_size)
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = scheduler.schedule()
        _commit(batch)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        assert len(batch.chunks) == num_running
    scheduler.audit()
    times.sort()
    cpu_times.sort()
    return {
        "running": num_running,
        "steps": steps,
        "mean_ms": 1e3 * sum(times) / steps,
        "p50_ms": 1e3 * times[steps // 2],
        "p99_ms": 1e3 * times[int(steps * 0.99)],
        "cpu_p50_ms": 1e3 * cpu_times[steps // 2],
    }


def simulate_cost(clients: int = 1000, seed: int = 1) -> dict:
    """Wall time of a simulation with preemption and hang-ups (crowd pass + solo reruns), and per step."""
    report = simulate(mixed_crowd(seed, clients, hangup_fraction=0.25), SimulationConfig())
    assert report.ok and report.preemptions > 0 and report.hung_up > 0
    return {"clients": clients, "wall_seconds": report.wall_seconds, "steps": report.steps,
            "solo_steps": report.solo_steps, "wall_us_per_step": report.wall_us_per_step,
            "preemptions": report.preemptions}


RUNNING = (16, 64, 256, 1024)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pagoda.core.machine import configure_threads

    p = argparse.ArgumentParser(prog="pagoda bench scheduler", description=__doc__.split("\n")[0])
    p.add_argument("--running", default=",".join(map(str, RUNNING)), help="requests decoding side by side, per row")
    p.add_argument("--steps", type=int, default=500, help="decode steps timed per row")
    p.add_argument("--clients", type=int, default=1000, help="the simulation's crowd (0: skip it)")
    args = p.parse_args(argv)
    configure_threads(1)  # as `pagoda simulate` does: the fake model's tensors are tiny
    print("| scheduler + ledger per decode step | running | mean ms | p50 ms | p99 ms | CPU p50 ms | CPU us per request |")
    print("|---|---|---|---|---|---|---|")
    for num_running in (int(n) for n in args.running.split(",")):
        cost = scheduler_step_cost(num_running, steps=args.steps)
        print(f"| schedule() + commit | {cost['running']} | {cost['mean_ms']:.3f} | {cost['p50_ms']:.3f} "
              f"| {cost['p99_ms']:.3f} | {cost['cpu_p50_ms']:.3f} | {1e3 * cost['cpu_p50_ms'] / num_running:.2f} |",
              flush=True)
    if args.clients:
        sim = simulate_cost(args.clients)
        print()
        print(f"simulate: {sim['clients']} clients, {sim['steps']} crowd steps + {sim['solo_steps']} solo steps, "
              f"{sim['preemptions']} preemptions: {sim['wall_seconds']:.2f} s wall, {sim['wall_us_per_step']:.0f} us a step")
    return 0
