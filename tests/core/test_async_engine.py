"""AsyncEngine: the loop thread, the abort in generate's finally, questions asked of the loop, and LoRA adapters' loads
and unloads."""

import asyncio
import contextlib
import gc
import threading

import pytest

from pagoda.core.async_engine import AsyncEngine, EngineDeadError, GenerationError, RequestAborted
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import AdmissionError
from pagoda.core.scheduling import SchedulingPolicy
from tests.helpers import await_condition, fake_engine, run

GREEDY = SamplingParams(max_tokens=8, temperature=0)


class GatedRunner:
    """Wraps a runner so that each step waits for the test to allow it: the test counts steps exactly."""

    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple
        self.allowed = threading.Semaphore(0)
        self.steps = 0

    def execute(self, batch):
        assert self.allowed.acquire(timeout=30), "the test never allowed this step"
        self.steps += 1
        return self.runner.execute(batch)

    def open(self):
        """Let every later step run freely."""
        for _ in range(10_000):
            self.allowed.release()


class FailingRunner:
    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple

    def execute(self, batch):
        raise RuntimeError("device lost")


@pytest.fixture
def make_engine():
    """Builds started AsyncEngines around fake engines and stops them all at the end."""
    started = []

    def make(wrap=None, **config):
        engine = fake_engine(**config)
        if wrap is not None:
            engine.runner = wrap(engine.runner)
        async_engine = AsyncEngine(engine)
        async_engine.start()
        started.append(async_engine)
        return async_engine

    yield make
    for e in started:
        e.stop()


async def collect(engine, prompt, params=GREEDY, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def assert_pool_whole(engine):
    await engine.wait_until_idle()
    await engine.audit()
    stats = await engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return stats


def test_generate_streams_every_token_and_matches_the_offline_engine(make_engine):
    async_engine = make_engine()
    outs = run(collect(async_engine, [1, 2, 3], request_id="a"))
    assert [o.finished for o in outs] == [False] * 7 + [True]
    offline = fake_engine()
    offline.add_request("a", [1, 2, 3], GREEDY)
    expected = [t for o in offline.run() for t in o.new_token_ids]
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_output_tokens == 8


def test_concurrent_requests_each_get_their_own_stream(make_engine):
    async_engine = make_engine(max_running=2)  # four callers, two slots: some wait their turn

    async def main():
        prompts = {f"r{i}": [i + 1, i + 2] for i in range(4)}
        results = await asyncio.gather(*(collect(async_engine, p, request_id=rid) for rid, p in prompts.items()))
        stats = await assert_pool_whole(async_engine)
        return prompts, results, stats

    prompts, results, stats = run(main())
    assert stats["peak_running"] == 2
    for (rid, prompt), outs in zip(prompts.items(), results):
        solo = fake_engine()
        solo.add_request(rid, prompt, GREEDY)
        assert [t for o in outs for t in o.new_token_ids] == [t for o in solo.run() for t in o.new_token_ids]


def test_admission_error_is_raised_before_any_output(make_engine):
    async_engine = make_engine(num_blocks=4, block_size=4)

    async def main():
        gen = async_engine.generate([1] * 10, SamplingParams(max_tokens=50))  # needs 15 blocks of a 4-block pool
        with pytest.raises(AdmissionError, match="KV blocks"):
            await gen.__anext__()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(async_engine, [10_000])
        return await assert_pool_whole(async_engine)

    stats = run(main())
    assert stats["requests_total"] == 0 and stats["aborted_total"] == 0


def test_a_refused_duplicate_id_does_not_abort_the_live_request(make_engine):
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", GatedRunner(r)))
    runner = gated["runner"]

    async def main():
        first = async_engine.generate([1, 2], GREEDY, "same")
        runner.allowed.release()
        await first.__anext__()
        # The loop thread now waits inside the next step; queue the duplicate, then let that step end.
        duplicate = asyncio.create_task(collect(async_engine, [3], request_id="same"))
        await asyncio.sleep(0)
        runner.allowed.release()
        with pytest.raises(ValueError, match="already live"):
            await duplicate
        runner.open()
        rest = [o async for o in first]
        return rest, await assert_pool_whole(async_engine)

    rest, stats = run(main())
    assert rest[-1].finished and rest[-1].finish_reason.value == "length"
    assert sum(len(o.new_token_ids) for o in rest) == GREEDY.max_tokens - 1
    assert stats["aborted_total"] == 0


def _abort_within_one_step(make_engine, leave, consumed_by_leave=0):
    """Consume 3 outputs one step at a time, leave via `leave`, then let the engine run freely."""
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", GatedRunner(r)))
    runner = gated["runner"]
    params = SamplingParams(max_tokens=50, temperature=0)

    async def main():
        gen = async_engine.generate([1, 2, 3], params, "leaver")
        seen = []
        for _ in range(3):
            runner.allowed.release()
            seen.append(await gen.__anext__())
        await leave(gen, runner)
        runner.open()
        return seen, await assert_pool_whole(async_engine)

    seen, stats = run(main())
    assert not seen[-1].finished
    assert stats["aborted_total"] == 1
    # The abort landed at the next step: at most one step ran after the caller left.
    consumed = 3 + consumed_by_leave
    assert consumed <= stats["generated_tokens_total"] <= consumed + 1, stats
    assert runner.steps <= consumed + 1


def test_closing_the_generator_early_aborts_within_a_step(make_engine):
    async def leave(gen, runner):
        await gen.aclose()

    _abort_within_one_step(make_engine, leave)


def test_cancelling_the_consuming_task_aborts_within_a_step(make_engine):
    async def leave(gen, runner):
        async def consume():
            async for _ in gen:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # let it reach its await on the next output (no step is allowed yet)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _abort_within_one_step(make_engine, leave)


def test_an_exception_in_the_consumer_aborts(make_engine):
    async def leave(gen, runner):
        async def consume():
            async with contextlib.aclosing(gen):
                async for _ in gen:
                    raise KeyError("renderer bug")

        runner.allowed.release()
        with pytest.raises(KeyError):
            await consume()

    _abort_within_one_step(make_engine, leave, consumed_by_leave=1)


def test_dropping_an_unfinished_generator_aborts_it(make_engine):
    # No aclose: the last reference goes away and the event loop's async-generator finalizer closes it.
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", GatedRunner(r)))
    runner = gated["runner"]

    async def main():
        async def start_and_drop():
            gen = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=50, temperature=0), "dropped")
            runner.allowed.release()
            return (await gen.__anext__()).num_output_tokens

        n = await start_and_drop()  # the generator is unreachable once this returns
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)  # the finalizer schedules aclose() as a task
        runner.open()
        return n, await assert_pool_whole(async_engine)

    n, stats = run(main())
    assert n == 1 and stats["aborted_total"] == 1
    assert stats["generated_tokens_total"] <= 2


def test_cancelled_while_waiting_for_admission_leaves_nothing_behind(make_engine):
    async_engine = make_engine()

    async def main():
        tasks = [asyncio.create_task(collect(async_engine, [1, 2], SamplingParams(max_tokens=50))) for _ in range(8)]
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await assert_pool_whole(async_engine)

    stats = run(main())
    # Each request was either never added, or added and then aborted: none ran to its end.
    assert stats["generated_tokens_total"] < 8 * 50
    assert stats["requests_total"] == stats["aborted_total"]


def test_a_failed_model_step_raises_in_the_caller_and_the_engine_keeps_serving(make_engine):
    async_engine = make_engine()

    async def main():
        healthy = async_engine.engine.runner
        async_engine.engine.runner = FailingRunner(healthy)
        with pytest.raises(GenerationError, match="device lost"):
            await collect(async_engine, [1, 2])
        async_engine.engine.runner = healthy
        outs = await collect(async_engine, [1, 2])
        return outs, await assert_pool_whole(async_engine)

    outs, stats = run(main())
    assert outs[-1].finished and stats["failed_total"] == 1


def test_stop_aborts_live_requests_and_refuses_new_ones(make_engine):
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", GatedRunner(r)))
    runner = gated["runner"]

    async def main():
        gen = async_engine.generate([1, 2], SamplingParams(max_tokens=50))
        runner.allowed.release()
        await gen.__anext__()
        async_engine.stop(timeout=0)  # ask first (the loop may be parked inside step 2), then let steps run
        runner.open()
        await asyncio.to_thread(async_engine.stop)
        with pytest.raises((RequestAborted, EngineDeadError)):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.stats()

    run(main())
    assert not async_engine.is_running
    engine = async_engine.engine
    assert engine.counters.aborted_total == 1 and engine.counters.generated_tokens_total <= 2  # at most the step in flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_crashed_loop_fails_callers_instead_of_hanging_them(make_engine):
    async_engine = make_engine()

    def broken_step():
        raise AssertionError("scheduler invariant broken")

    async def main():
        async_engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="invariant"):
            await collect(async_engine, [1, 2])
        with pytest.raises(EngineDeadError):
            await async_engine.stats()

    run(main())
    assert not async_engine.is_running


def test_an_idle_loop_sleeps(make_engine):
    async_engine = make_engine()
    run(collect(async_engine, [1, 2]))
    run(async_engine.wait_until_idle())
    before = async_engine.num_wakeups
    threading.Event().wait(0.2)  # an interval of idleness, not a wait for a condition
    assert async_engine.num_wakeups == before
    run(async_engine.stats())
    assert async_engine.num_wakeups == before + 1  # one command, one wake-up



def test_latest_stats_answer_during_a_step_and_refuse_a_stuck_one(make_engine):
    gate = []
    async_engine = make_engine(wrap=lambda r: gate.append(GatedRunner(r)) or gate[0])
    before = async_engine.latest_stats(stuck_after=60)
    assert before["requests_total"] == 0

    async def main():
        task = asyncio.ensure_future(collect(async_engine, [1, 2, 3]))
        await await_condition(lambda: async_engine.latest_stats(60)["requests_total"] == 1, "the admission shown")
        # the first step waits at the gate: the snapshot still answers, until the step counts as stuck
        with pytest.raises(EngineDeadError, match="step in progress"):
            await await_condition(lambda: async_engine.latest_stats(stuck_after=0.05) is None, "a stuck step")
        gate[0].open()
        outs = await task
        stats = async_engine.latest_stats(stuck_after=60)
        assert stats["generated_tokens_total"] == len([t for o in outs for t in o.new_token_ids]) == 8
        assert stats["running"] == 0

    run(main())
    async_engine.stop()
    with pytest.raises(EngineDeadError):
        async_engine.latest_stats(stuck_after=60)


def test_generate_keys_the_prefix_cache_by_salt_and_tenant():
    """The async engine hands cache_salt and tenant to the engine: only equal keys share cached blocks."""
    loop_engine = AsyncEngine(fake_engine(num_blocks=64, block_size=4))
    loop_engine.start()
    prompt = list(range(1, 18))  # 4 full blocks of 4, and one token more

    async def cached(**keys) -> int:
        outs = [o async for o in loop_engine.generate(prompt, SamplingParams(max_tokens=2), **keys)]
        return outs[-1].num_cached_tokens

    async def run() -> list[int]:
        return [await cached(tenant="a"), await cached(tenant="b"), await cached(tenant="a"),
                await cached(tenant="a", cache_salt="s"), await cached(tenant="a", cache_salt="s")]

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == [0, 0, 16, 0, 16]
    finally:
        loop_engine.stop()


class Anticipating(SchedulingPolicy):
    """fcfs, but asks the loop to wait `wait` seconds before each of the next `times` steps, and says when."""

    def __init__(self):
        self.wait, self.times = 0.0, 0
        self.asked = threading.Event()

    def anticipation(self, running, waiting):
        if self.times <= 0:
            return 0.0
        self.times -= 1
        self.asked.set()
        return self.wait


def test_the_loop_waits_as_the_policy_asks_and_an_arrival_ends_the_wait(make_engine):
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", GatedRunner(r)), max_running=2)
    runner = gated["runner"]
    policy = async_engine.engine.scheduler.policy = Anticipating()

    async def main():
        a = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=60, temperature=0), "a")
        runner.allowed.release()
        await anext(a)
        # a's next step waits for the gate, so a is still running when the policy is asked next. Ungated, a could
        # finish first: the wait would then come before b's own first step, with nothing left to arrive and end it.
        policy.wait, policy.times = 3600.0, 1  # far past the test's deadline: only an arrival can end this wait
        runner.open()
        assert await asyncio.to_thread(policy.asked.wait, 30), "the loop never asked the policy while a ran"
        b = async_engine.generate([4, 5], SamplingParams(max_tokens=2, temperature=0), "b")
        first = await asyncio.wait_for(anext(b), 30)  # the arrival ended the wait: b's prefill step ran
        return first, [out async for out in b], [out async for out in a]

    first, rest, outs = run(main())
    assert first.new_token_ids and rest[-1].finished and outs[-1].finished
    run(assert_pool_whole(async_engine))


def test_a_wait_with_no_arrival_ends_by_itself(make_engine):
    async_engine = make_engine()
    policy = async_engine.engine.scheduler.policy = Anticipating()
    policy.wait, policy.times = 0.01, 1000  # before every step of this request; nothing arrives to end a wait
    outs = run(collect(async_engine, [1, 2], SamplingParams(max_tokens=5, temperature=0)))
    assert outs[-1].finished and outs[-1].num_output_tokens == 5
    assert policy.times <= 1000 - 4  # it waited before the steps after the first


# -- LoRA adapters: loads off the loop, unloads whose callers leave or whose loop ends ----------------

class AdapterGate(GatedRunner):
    """The gated fake model with its LoRA methods; a load's preparation may be held on `prepare_gate`, and an
    unload may fail after it is done (a tensor-parallel group's broadcast failing)."""

    def __init__(self, runner):
        super().__init__(runner)
        self.prepare_gate: threading.Event | None = None
        self.preparing = threading.Event()
        self.unload_error: BaseException | None = None

    def prepare_adapter(self, name, path, max_rank):
        self.preparing.set()
        if self.prepare_gate is not None:
            assert self.prepare_gate.wait(30), "the test never let the load go on"
        return self.runner.prepare_adapter(name, path, max_rank)

    def install_adapter(self, prepared):
        return self.runner.install_adapter(prepared)

    def load_adapter(self, name, path, max_rank):
        return self.install_adapter(self.prepare_adapter(name, path, max_rank))

    def unload_adapter(self, name):
        self.runner.unload_adapter(name)
        if self.unload_error is not None:
            raise self.unload_error


@pytest.fixture
def adapter_engine(make_engine):
    """A started AsyncEngine over the gated fake model, with adapter "x" loaded (through the async load)."""
    gated = {}
    async_engine = make_engine(wrap=lambda r: gated.setdefault("runner", AdapterGate(r)))
    run(async_engine.load_adapter("x", "/adapters/x"))
    return async_engine, gated["runner"]


async def unload_pending(async_engine, runner):
    """A request of "x" past its first step, and an unload of "x" waiting for it (the loop parked in a step)."""
    gen = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=50, temperature=0), adapter="x")
    runner.allowed.release()
    await gen.__anext__()
    unload = asyncio.ensure_future(async_engine.unload_adapter("x"))
    for _ in range(20):  # bounded: the loop takes the unload between the first two steps after it is asked
        if "x" not in async_engine.adapters:
            break
        steps = runner.steps
        runner.allowed.release()
        await await_condition(lambda: runner.steps > steps or "x" not in async_engine.adapters, "a step")
    assert "x" not in async_engine.adapters  # the unload has begun; the request is far from its 50 tokens
    return gen, unload


@pytest.mark.parametrize("ending", ["abort", "finish"])
def test_an_unload_whose_caller_leaves_goes_on_and_the_loop_keeps_serving(adapter_engine, ending):
    async_engine, runner = adapter_engine

    async def main():
        gen, unload = await unload_pending(async_engine, runner)
        unload.cancel()  # the caller leaves (an HTTP client gone): its wait ends, not the unload
        with pytest.raises(asyncio.CancelledError):
            await unload
        runner.open()
        if ending == "abort":  # the adapter's last request ends by its caller leaving too
            await gen.aclose()
        else:
            outs = [out async for out in gen]
            assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 50
        stats = await assert_pool_whole(async_engine)
        assert (stats["lora_adapters_loaded"], stats["lora_adapters_in_use"]) == (0, 0)  # unloaded all the same
        return await collect(async_engine, [1, 2])

    assert run(main())[-1].finished and async_engine.is_running  # the loop serves on
    assert "x" not in async_engine.engine.runner.runner.adapters


def test_a_pending_unload_fails_when_the_loop_crashes(adapter_engine):
    async_engine, runner = adapter_engine

    def broken_step():
        raise AssertionError("scheduler invariant broken")

    async def main():
        gen, unload = await unload_pending(async_engine, runner)
        async_engine.engine.step = broken_step  # the loop's next step
        runner.open()
        with pytest.raises(EngineDeadError, match="invariant"):
            await asyncio.wait_for(unload, 30)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    run(main())
    assert not async_engine.is_running


@pytest.mark.parametrize("unload_fails", [False, True])
def test_a_pending_unload_is_answered_when_the_loop_stops(adapter_engine, unload_fails):
    """Stopping aborts the adapter's requests, so the unload happens and its wait ends: with the adapter, or with
    the runner's error when its unload fails (never a wait that does not end)."""
    async_engine, runner = adapter_engine

    async def main():
        gen, unload = await unload_pending(async_engine, runner)
        if unload_fails:
            runner.unload_error = RuntimeError("the group's broadcast failed")
        async_engine.stop(timeout=0)  # ask first (the loop may be parked inside a step), then let steps run
        runner.open()
        await asyncio.to_thread(async_engine.stop)
        if unload_fails:
            with pytest.raises(RuntimeError, match="broadcast"):
                await asyncio.wait_for(unload, 30)
        else:
            assert (await asyncio.wait_for(unload, 30)).name == "x"
        with pytest.raises((RequestAborted, EngineDeadError)):
            async for _ in gen:
                pass

    run(main())
    assert not async_engine.is_running and async_engine.failure is None  # stopped, not crashed
    assert async_engine.engine.adapters.loaded == {} and async_engine.engine.adapters.unloading == {}


def test_a_load_reads_its_adapter_off_the_loop_while_streams_run(adapter_engine):
    async_engine, runner = adapter_engine
    runner.open()
    runner.prepare_gate = threading.Event()

    async def main():
        load = asyncio.ensure_future(async_engine.load_adapter("y", "/adapters/y"))
        assert await asyncio.to_thread(runner.preparing.wait, 30), "the load never started"
        # the load is held in its reading: requests are served meanwhile, on the base and on a loaded adapter
        base = await asyncio.wait_for(collect(async_engine, [1, 2]), 30)
        adapted = await asyncio.wait_for(_collect_adapter(async_engine, "x"), 30)
        assert base[-1].finished and adapted[-1].finished and not load.done()
        assert "y" not in async_engine.adapters
        runner.prepare_gate.set()
        info = await asyncio.wait_for(load, 30)
        assert info.name == "y" and "y" in async_engine.adapters
        return await _collect_adapter(async_engine, "y")

    assert run(main())[-1].finished


async def _collect_adapter(async_engine, adapter: str) -> list:
    return [out async for out in async_engine.generate([1, 2], GREEDY, adapter=adapter)]
