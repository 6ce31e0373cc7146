"""The scheduler's LoRA rule: at most `max_loras` distinct adapters among the running requests; a waiting request
whose adapter would be one too many stops the admission of adapter requests (none overtakes it) while base requests
still come in past it, in the policy's order and within the pool, the slots and the budget; it runs once a running
adapter's last request has left."""

from __future__ import annotations

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduling import FairPolicy, PriorityPolicy, SchedulingPolicy
from tests.helpers import advance


def make(max_loras: int = 2, max_running: int = 8, num_blocks: int = 64, max_batched_tokens: int = 64,
         policy: SchedulingPolicy | None = None) -> Scheduler:
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_running=max_running,
                          max_batched_tokens=max_batched_tokens, max_model_len=128, max_loras=max_loras,
                          speculative=None)
    return Scheduler(config, BlockManager(config.num_blocks, config.block_size, True), policy=policy)


def req(rid: str, adapter: str | None, max_tokens: int = 4, prompt_len: int = 5, **kw) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   adapter=adapter, **kw)


def ids(batch) -> list[str]:
    return [c.request.request_id for c in batch.chunks]


def test_a_third_adapter_waits_while_base_requests_run_past_it_and_runs_as_soon_as_an_adapter_leaves():
    s = make(max_loras=2)
    x, y = req("x1", "x", max_tokens=3), req("y1", "y", max_tokens=12)
    s.add(x)
    s.add(y)
    batch = s.schedule()
    assert ids(batch) == ["x1", "y1"]
    advance(s, batch)
    z, base, x2 = req("z1", "z"), req("base", None, max_tokens=12), req("x2", "x")
    for r in (z, base, x2):
        s.add(r)
    # z1 would be a third adapter: it waits. The base request behind it comes in (it takes no adapter slot); x2
    # would not add an adapter (x runs), yet no adapter request overtakes z1
    batch = s.schedule()
    assert ids(batch) == ["x1", "y1", "base"] and base.status is RequestStatus.RUNNING
    assert [r.request_id for r in s.waiting] == ["z1", "x2"]
    assert all(r.status is RequestStatus.WAITING for r in (z, x2))
    advance(s, batch)
    batch = s.schedule()  # x1's last token
    assert ids(batch) == ["x1", "y1", "base"] and [r.request_id for r in s.waiting] == ["z1", "x2"]
    advance(s, batch)
    assert x not in s.running  # x's last request has left...
    batch = s.schedule()
    # ... and z1 takes its place at once; x2 would be a third adapter now: it waits
    assert ids(batch) == ["y1", "base", "z1"]
    assert [r.request_id for r in s.waiting] == ["x2"]
    assert len({c.request.adapter for c in batch.chunks} - {None}) == 2
    for _ in range(64):  # bounded: y1 and z1 end, then x2 runs
        if not s.waiting:
            break
        advance(s, batch)
        batch = s.schedule()
    assert "x2" in ids(batch) and not s.waiting


def test_base_requests_past_a_waiting_adapter_take_only_free_slots_and_blocks_and_none_overtakes_another():
    # slots: two run, one is free: one base request comes in past z1, the next waits
    s = make(max_loras=1, max_running=3)
    s.add(req("x1", "x", max_tokens=20))
    s.add(req("x2", "x", max_tokens=20))
    advance(s, s.schedule())
    for r in (req("z1", "z"), req("b1", None), req("b2", None)):
        s.add(r)
    assert ids(s.schedule()) == ["x1", "x2", "b1"] and [r.request_id for r in s.waiting] == ["z1", "b2"]
    # blocks: a base request short of blocks stops admission; a smaller one behind it does not overtake it
    s = make(max_loras=1, num_blocks=8)  # 32 slots
    s.add(req("x1", "x", max_tokens=20, prompt_len=8))  # 2 blocks now
    advance(s, s.schedule())
    for r in (req("z1", "z"), req("big", None, prompt_len=28), req("small", None, prompt_len=2)):
        s.add(r)
    assert ids(s.schedule()) == ["x1"] and [r.request_id for r in s.waiting] == ["z1", "big", "small"]
    # the budget: what is left of it goes to the base requests past z1, the last one's prefill in part
    s = make(max_loras=1, max_batched_tokens=12)
    s.add(req("x1", "x", max_tokens=20))
    advance(s, s.schedule())
    for r in (req("z1", "z"), req("b1", None, prompt_len=5), req("b2", None, prompt_len=9)):
        s.add(r)
    batch = s.schedule()
    assert ids(batch) == ["x1", "b1", "b2"] and [c.num_tokens for c in batch.chunks] == [1, 5, 6]
    assert [r.request_id for r in s.waiting] == ["z1"]


def test_an_adapter_request_short_of_blocks_lets_nobody_past_it():
    s = make(max_loras=1, num_blocks=8)
    s.add(req("x1", "x", max_tokens=20, prompt_len=8))
    advance(s, s.schedule())
    for r in (req("z1", "z", prompt_len=28), req("b1", None, prompt_len=2)):
        s.add(r)
    # z1 is held back by the pool before its adapter is looked at: the rule for blocks holds (nobody overtakes)
    assert ids(s.schedule()) == ["x1"] and [r.request_id for r in s.waiting] == ["z1", "b1"]


def test_the_priority_and_fair_policies_admit_base_requests_past_a_waiting_adapter_in_their_own_order():
    s = make(max_loras=1, policy=PriorityPolicy())
    s.add(req("x1", "x", max_tokens=20))
    advance(s, s.schedule())
    for r in (req("z1", "z", priority=0), req("late", None, priority=5), req("soon", None, priority=1),
              req("x2", "x", priority=2)):
        s.add(r)
    assert ids(s.schedule()) == ["x1", "soon", "late"]  # by priority; x2 (an adapter request) does not pass z1
    assert [r.request_id for r in s.waiting] == ["z1", "x2"]

    s = make(max_loras=1, policy=FairPolicy())
    s.add(req("x1", "x", max_tokens=20, tenant="a"))
    s.add(req("x2", "x", max_tokens=20, tenant="a"))
    advance(s, s.schedule())
    for r in (req("z1", "z", tenant="b"), req("a2", "x", tenant="a"), req("b1", None, tenant="b"),
              req("a1", None, tenant="a")):
        s.add(r)
    batch = s.schedule()
    # b runs the least (z1 counts as started by the policy): its base request first, then a's, which came after
    # a's adapter request a2: that one waits behind z1
    assert ids(batch) == ["x1", "x2", "b1", "a1"]
    assert [r.request_id for r in s.waiting] == ["z1", "a2"]


def test_with_no_adapter_held_back_a_running_adapters_requests_and_base_requests_run_together():
    s = make(max_loras=1)
    for r in (req("x1", "x"), req("base", None), req("x2", "x")):
        s.add(r)
    batch = s.schedule()
    assert ids(batch) == ["x1", "base", "x2"]  # one adapter, however many of its requests, and the base beside it


def test_max_loras_1_runs_adapters_one_after_another_in_arrival_order():
    s = make(max_loras=1)
    for r in (req("x1", "x", max_tokens=2), req("y1", "y", max_tokens=2), req("x2", "x", max_tokens=2)):
        s.add(r)
    order: list[list[str]] = []
    for _ in range(32):
        if not s.waiting and not s.running:
            break
        batch = s.schedule()
        order.append(ids(batch))
        assert len({c.request.adapter for c in batch.chunks} - {None}) <= 1
        advance(s, batch)
    # x2 does not overtake y1, although its adapter is running while y1 waits
    assert order[0] == ["x1"] and ["y1"] in order and order.index(["y1"]) < min(i for i, o in enumerate(order) if "x2" in o)
