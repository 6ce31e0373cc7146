"""The scheduling policies (core/scheduling.py): each one's order, token shares and preemption choice, audited."""

from collections import deque

import pytest

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduling import (
    BUILTIN_POLICIES, FairPolicy, PriorityPolicy, SchedulingPolicy, make_policy, water_fill,
)
from tests.helpers import advance


def make(policy=None, num_blocks=256, block_size=4, max_running=4, max_batched_tokens=64):
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_running=max_running,
                          max_batched_tokens=max_batched_tokens, max_model_len=256, speculative=None)
    return Scheduler(config, BlockManager(num_blocks, block_size, True), policy=policy)


def req(rid, prompt_len=4, max_tokens=4, tenant=None, priority=0, weight=1.0, arrival=0.0):
    prompt = [hash((rid, i)) % 200 + 1 for i in range(prompt_len)]  # distinct prompts: no prefix sharing
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival, tenant=tenant,
                   priority=priority, weight=weight)


def step(s):
    """One schedule, then what the runner and engine would do: tokens computed, one sampled, finished ones out."""
    batch = s.schedule()
    advance(s, batch)
    return batch


def running_by_tenant(s):
    counts = {}
    for r in s.running:
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
    return counts


def test_the_builtin_names_and_an_unknown_name_refused():
    assert set(BUILTIN_POLICIES) == {"fcfs", "priority", "fair"}
    assert isinstance(make_policy("fair"), FairPolicy)
    assert make_policy("fair") is not make_policy("fair")  # each scheduler gets its own state
    with pytest.raises(ValueError, match="choose one of fair, fcfs, priority"):
        make_policy("lottery")


def test_fcfs_is_the_default_and_admits_in_arrival_order():
    s = make()
    assert type(s.policy) is SchedulingPolicy and s.policy.name == "fcfs"
    for i in range(6):
        s.add(req(f"r{i}", priority=5 - i))  # priorities are ignored
    step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2", "r3"]


def test_priority_admits_lower_numbers_first_and_ties_by_arrival():
    s = make(PriorityPolicy(), max_running=3)
    for rid, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)):
        s.add(req(rid, priority=priority))
    assert [r.request_id for r in s.waiting] == ["b", "d", "c", "a", "e"]
    step(s)
    assert [r.request_id for r in s.running] == ["b", "d", "c"]


def test_priority_preempts_the_lowest_priority_newest_for_a_better_arrival():
    s = make(PriorityPolicy(), max_running=3)
    for rid, priority in (("a", 1), ("b", 3), ("c", 3)):
        s.add(req(rid, priority=priority, max_tokens=20))
    step(s)
    s.add(req("urgent", priority=0, max_tokens=20))
    batch = step(s)
    assert batch.preempted_ids == ["c"]  # priority 3, and newer than b
    assert {r.request_id for r in s.running} == {"a", "b", "urgent"}
    assert s.waiting[0].request_id == "c"  # at the front of its priority class
    s.add(req("late", priority=3))
    assert [r.request_id for r in s.waiting] == ["c", "late"]


def test_priority_victim_for_blocks_is_the_lowest_priority_newest():
    policy = PriorityPolicy()
    rs = [req("x", priority=1), req("y", priority=4), req("z", priority=4), req("w", priority=2)]
    assert policy.victim(rs, rs).request_id == "z"


def test_water_fill_gives_min_of_demand_and_weighted_share():
    assert water_fill(100, {"a": 1000, "b": 1000}, {"a": 1.0, "b": 1.0}) == {"a": 50, "b": 50}
    assert water_fill(100, {"a": 1000, "b": 10}, {"a": 1.0, "b": 1.0}) == {"a": 90, "b": 10}
    assert water_fill(100, {"a": 1000, "b": 1000}, {"a": 3.0, "b": 1.0}) == {"a": 75, "b": 25}
    grants = water_fill(10, {"a": 9, "b": 9, "c": 9}, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sum(grants.values()) == 10 and min(grants.values()) == 3


@pytest.mark.parametrize("weights, expected", [((1.0, 1.0), {"A": 2, "B": 2}), ((3.0, 1.0), {"A": 3, "B": 1})])
def test_fair_shares_slots_by_weight_from_the_first_step(weights, expected):
    s = make(FairPolicy(), max_running=4)
    for i in range(8):
        s.add(req(f"a{i}", tenant="A", weight=weights[0], max_tokens=8))
    for i in range(4):
        s.add(req(f"b{i}", tenant="B", weight=weights[1], max_tokens=8))
    step(s)
    assert running_by_tenant(s) == expected


def test_fair_admits_requests_that_name_no_tenant():
    """None is a tenant like any other (a server without keys, a crowd without tenants): it is admitted and shares."""
    s = make(FairPolicy())
    for i in range(3):
        s.add(req(f"open{i}"))
    s.add(req("a0", tenant="a"))
    step(s)
    assert running_by_tenant(s) == {None: 3, "a": 1}


def test_fair_preempts_from_the_tenant_most_over_its_share_and_never_ping_pongs():
    s = make(FairPolicy(), max_running=4)
    for i in range(8):
        s.add(req(f"a{i}", tenant="A", max_tokens=30))
    step(s)
    assert running_by_tenant(s) == {"A": 4}
    s.add(req("b0", tenant="B", max_tokens=30))
    s.add(req("b1", tenant="B", max_tokens=30))
    batch = step(s)
    assert batch.preempted_ids == ["a3", "a2"]  # A's newest
    assert running_by_tenant(s) == {"A": 2, "B": 2}
    for _ in range(5):  # balanced: nobody is preempted again
        assert step(s).preempted_ids == []
        assert running_by_tenant(s) == {"A": 2, "B": 2}


def test_fair_shares_the_token_budget_between_prefilling_tenants():
    s = make(FairPolicy(), max_running=4, max_batched_tokens=40)
    s.add(req("a", tenant="A", prompt_len=200))
    s.add(req("b", tenant="B", prompt_len=200))
    batch = step(s)
    assert {c.request.request_id: c.num_tokens for c in batch.chunks} == {"a": 20, "b": 20}


def test_fair_victim_for_blocks_is_the_newest_of_the_most_loaded_tenant():
    policy = FairPolicy()
    rs = [req("a0", tenant="A"), req("b0", tenant="B"), req("a1", tenant="A"), req("b1", tenant="B"),
          req("a2", tenant="A")]
    policy.start_step(rs, deque(), 64, 8)
    assert policy.victim(rs[1:], rs).request_id == "a2"
    assert policy.victim(rs[1:4], rs).request_id == "a1"


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_every_policy_drains_a_tight_pool_with_the_audit_passing_after_every_step(name):
    s = make(make_policy(name), num_blocks=12, max_running=4, max_batched_tokens=16)
    for i in range(10):
        s.add(req(f"r{i}", prompt_len=3 + i % 5, max_tokens=6 + i % 4, tenant="AB"[i % 2], priority=i % 3,
                  weight=1.0 + i % 2, arrival=float(i)))
    for _ in range(500):
        if not (s.running or s.waiting):
            break
        step(s)
    assert not s.running and not s.waiting
    assert s.block_manager.num_free_blocks == 12


def test_fair_holds_a_departed_tenants_slot_for_one_step_so_its_next_request_preempts_nobody():
    """B's request ends; its slot stays empty for the step after (A's queue head does not take it), and B's next
    request, arriving during that step, is admitted into it without a preemption."""
    s = make(FairPolicy(), max_running=2)
    for i in range(6):
        s.add(req(f"a{i}", tenant="A", max_tokens=20))
    s.add(req("b0", tenant="B", max_tokens=2))
    step(s)
    assert running_by_tenant(s) == {"A": 1, "B": 1}
    step(s)  # b0's second token: it ends
    assert running_by_tenant(s) == {"A": 1}
    batch = step(s)
    assert running_by_tenant(s) == {"A": 1}  # held: a1 waits although a slot is free
    assert [c.request.request_id for c in batch.chunks] == ["a0"]
    s.add(req("b1", tenant="B", max_tokens=2))
    batch = step(s)
    assert batch.preempted_ids == [] and running_by_tenant(s) == {"A": 1, "B": 1}
    assert s.num_preemptions == 0


def test_fair_gives_a_held_slot_away_when_its_tenant_does_not_come_back():
    s = make(FairPolicy(), max_running=2)
    for i in range(6):
        s.add(req(f"a{i}", tenant="A", max_tokens=20))
    s.add(req("b0", tenant="B", max_tokens=1))
    step(s)  # b0 ends in its first step
    step(s)  # held
    assert running_by_tenant(s) == {"A": 1}
    step(s)  # B sent nothing: the slot is A's again
    assert running_by_tenant(s) == {"A": 2}


def test_fair_never_empties_a_step_to_hold_a_slot():
    """With one slot, holding it would leave the engine idle: the waiting request runs at once."""
    s = make(FairPolicy(), max_running=1)
    s.add(req("b0", tenant="B", max_tokens=1))
    s.add(req("a0", tenant="A", max_tokens=4))
    step(s)
    batch = step(s)
    assert [c.request.request_id for c in batch.chunks] == ["a0"]


def test_fair_waits_for_a_departed_tenant_only_once_it_has_come_back_within_its_hold():
    """The engine is asked to wait (FairPolicy.anticipation_s) before a step only for a tenant whose request just
    ended and whose next request came promptly the time before: a tenant that leaves for good costs no wait."""
    s = make(FairPolicy(), max_running=2)
    for i in range(6):
        s.add(req(f"a{i}", tenant="A", max_tokens=30))
    s.add(req("b0", tenant="B", max_tokens=1))
    step(s)  # b0 ends in its first step
    assert s.anticipation() == 0.0  # B has no history: no wait (its slot is still held for the step)
    step(s)
    s.add(req("b1", tenant="B", max_tokens=1))  # it came back within the hold
    step(s)  # b1 runs and ends
    assert s.anticipation() == FairPolicy.anticipation_s
    s.add(req("b2", tenant="B", max_tokens=1))  # it comes back during the wait: admitted at once
    assert s.anticipation() == 0.0
    batch = step(s)
    assert "b2" in [c.request.request_id for c in batch.chunks] and batch.preempted_ids == []
    assert s.anticipation() == FairPolicy.anticipation_s  # b2 ended too
    step(s)  # B does not come back this time: the slot is held for one step, then no more waits for B
    step(s)
    assert s.anticipation() == 0.0 and running_by_tenant(s) == {"A": 2}


def test_fcfs_and_priority_never_wait():
    for policy in (SchedulingPolicy(), PriorityPolicy()):
        s = make(policy, max_running=2)
        s.add(req("b0", tenant="B", max_tokens=1))
        s.add(req("a0", tenant="A", max_tokens=8))
        for _ in range(3):
            step(s)
            assert s.anticipation() == 0.0
