"""Property tests: random arrivals of requests under LoRA adapters (and the base), random max_loras and pools small
enough to preempt, through the real engine, scheduler and ledger on the simulator's fake model.

Checked from outside the scheduler (which asserts it too): no step runs rows of more than max_loras adapters; every
request finishes within a bound computed from the workload (a waiting adapter is never starved, base requests
admitted past it or not); a step admits past the first waiting request it leaves waiting only base requests, and
only when that request is an adapter request held back by the adapter rule; the ledger audit passes after every
step and the pool is whole at the end. And on whole crowds: every answer is its solo run's."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event, example, given, note
from hypothesis import strategies as st

from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from pagoda.simulator.simulate import SimulationConfig, simulate

BLOCK_SIZE = 4
NAMES = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Arrival:
    request_id: str
    step: int  # the engine step before which it arrives
    prompt: tuple[int, ...]
    max_tokens: int
    adapter: str | None


class Recorder(FakeModelRunner):
    """The fake model, noting the distinct adapters of every step's chunks."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.step_adapters: list[set[str]] = []

    def execute(self, batch):
        self.step_adapters.append({c.request.adapter for c in batch.chunks} - {None})
        return super().execute(batch)


@st.composite
def workloads(draw):
    """(arrivals, adapters loaded, engine config): requests whose longest fits the pool, in a pool that is often
    too small for them together."""
    adapters = NAMES[: draw(st.integers(1, len(NAMES)))]
    n = draw(st.integers(1, 10))
    arrivals = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 24))
        arrivals.append(Arrival(
            f"r{i}", draw(st.integers(0, 12)),
            tuple(draw(st.lists(st.integers(1, 63), min_size=prompt_len, max_size=prompt_len))),
            draw(st.integers(1, 16)), draw(st.sampled_from((None, *adapters))),
        ))
    longest = max(-(-(len(a.prompt) + a.max_tokens) // BLOCK_SIZE) for a in arrivals)
    config = EngineConfig(
        num_blocks=longest + draw(st.integers(0, 8)), block_size=BLOCK_SIZE, max_running=draw(st.integers(1, 6)),
        max_batched_tokens=draw(st.integers(8, 48)), max_model_len=64, max_loras=draw(st.integers(1, 3)),
    )
    return sorted(arrivals, key=lambda a: a.step), adapters, config


def step_bound(arrivals: list[Arrival]) -> int:
    """Generous: after the last arrival, every request's tokens (prompt and output) computed once for each request
    that could preempt it, one token a step, plus slack."""
    work = sum(len(a.prompt) + a.max_tokens for a in arrivals)
    return max(a.step for a in arrivals) + work * (len(arrivals) + 1) + 64


def watch_admissions(engine: Engine, max_loras: int, passed: list[int]) -> None:
    """Check each schedule's admissions (fcfs): the waiting requests admitted are the queue's head up to the first
    one left waiting, and past that one only base requests, and only when it is an adapter request whose adapter
    would be one too many. Counts in `passed` the base requests admitted past such a one."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def watched():
        before = list(scheduler.waiting)
        batch = schedule()
        left = {id(r) for r in scheduler.waiting}
        first_left = next((i for i, r in enumerate(before) if id(r) in left), len(before))
        past = [r for r in before[first_left + 1:] if id(r) not in left]
        if past:
            held = before[first_left]
            running = {r.adapter for r in scheduler.running} - {None}
            assert all(r.adapter is None for r in past), [r.request_id for r in past]
            assert held.adapter is not None and held.adapter not in running and len(running) == max_loras
            passed.append(len(past))
        return batch

    scheduler.schedule = watched


# max_loras 1: r1's adapter waits for r0's, and the base request r2 runs past it (and so does r4 later, past r3)
PASSING = ([Arrival("r0", 0, (1, 2, 3), 12, "a"), Arrival("r1", 0, (4, 5), 4, "b"),
            Arrival("r2", 0, (6, 7, 8), 4, None), Arrival("r3", 3, (9,) * 9, 6, "c"),
            Arrival("r4", 3, (10,) * 5, 2, None)], ("a", "b", "c"),
           EngineConfig(num_blocks=16, block_size=BLOCK_SIZE, max_running=4, max_batched_tokens=32, max_model_len=64,
                        max_loras=1))


def test_base_requests_run_past_a_waiting_adapter_which_still_finishes():
    _, passed = run_workload(PASSING)
    assert passed == [1, 1]


@example(workload=PASSING)
@given(workload=workloads())
def test_no_step_runs_more_than_max_loras_adapters_and_every_request_finishes(workload):
    engine, passed = run_workload(workload)
    stats = engine.stats()
    note(f"{stats['steps_total']} steps, {stats['preemptions_total']} preemptions")
    event(f"preempted: {stats['preemptions_total'] > 0}")
    event(f"a step ran max_loras adapters: {engine.runner.peak_step_adapters == engine.config.max_loras}")
    event(f"base requests admitted past a waiting adapter: {bool(passed)}")


def run_workload(workload) -> tuple[Engine, list[int]]:
    """Run the arrivals through an engine, checking as the module's docstring says; the engine, and the base
    requests admitted past a waiting adapter request, per step that admitted any."""
    arrivals, adapters, config = workload
    runner = Recorder(config.num_blocks, BLOCK_SIZE, vocab_size=64)
    engine = Engine(runner, config, eos_token_ids=(EOS_TOKEN_ID,))
    for name in adapters:
        engine.load_adapter(name, f"/adapters/{name}")
    passed: list[int] = []
    watch_admissions(engine, config.max_loras, passed)
    pending, finished, bound = list(arrivals), set(), step_bound(arrivals)
    steps = 0
    while pending or engine.has_unfinished():
        assert steps < bound, f"{len(finished)} of {len(arrivals)} finished in {bound} steps"
        while pending and pending[0].step <= steps:
            a = pending.pop(0)
            engine.add_request(a.request_id, list(a.prompt), SamplingParams(max_tokens=a.max_tokens, temperature=0),
                               adapter=a.adapter)
        finished |= {out.request_id for out in engine.step() if out.finished}
        engine.audit()
        steps += 1
    assert finished == {a.request_id for a in arrivals}
    assert all(len(used) <= config.max_loras for used in runner.step_adapters), runner.step_adapters
    assert runner.peak_step_adapters <= config.max_loras
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["lora_adapters_in_use"] == 0
    return engine, passed


@st.composite
def adapter_crowds(draw):
    adapters = NAMES[: draw(st.integers(1, 3))]
    plans = []
    for i in range(draw(st.integers(1, 14))):
        sampled = draw(st.booleans())
        plans.append(ClientPlan(
            client_id=f"c{i}", arrival=draw(st.floats(0, 0.2, allow_nan=False)), prompt_len=draw(st.integers(1, 24)),
            max_tokens=draw(st.integers(1, 16)), temperature=0.9 if sampled else 0.0,
            seed=draw(st.integers(0, 2**31 - 1)) if sampled else None,
            hangup_after=draw(st.none() | st.floats(0, 0.1, allow_nan=False)),
            adapter=draw(st.sampled_from((None, *adapters))),
        ))
    return plans


@given(crowd=adapter_crowds(), max_loras=st.integers(1, 3), num_blocks=st.integers(10, 40),
       max_running=st.integers(1, 8))
def test_any_adapter_crowd_answers_as_each_client_alone(crowd, max_loras, num_blocks, max_running):
    engine = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_running=max_running, max_batched_tokens=48,
                          max_model_len=64, max_loras=max_loras)
    report = simulate(crowd, SimulationConfig(engine=engine))
    note(str(report.summary()))
    assert report.audit == "ok" and report.pool["free"] == report.pool["total"]
    assert report.matches_solo
    assert report.peak_step_adapters <= max_loras
    assert report.completed + report.hung_up + report.refused == len(crowd)
