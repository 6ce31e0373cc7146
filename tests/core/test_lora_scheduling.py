"""The scheduler's LoRA rule: at most `max_loras` distinct adapters among the running requests; a waiting request
whose adapter would be one too many stops admission (nobody overtakes it) and runs once a running adapter's last
request has left."""

from __future__ import annotations

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from tests.helpers import advance


def make(max_loras: int = 2, max_running: int = 8) -> Scheduler:
    config = EngineConfig(num_blocks=64, block_size=4, max_running=max_running, max_batched_tokens=64,
                          max_model_len=128, max_loras=max_loras, speculative=None)
    return Scheduler(config, BlockManager(config.num_blocks, config.block_size, True))


def req(rid: str, adapter: str | None, max_tokens: int = 4, prompt_len: int = 5) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   adapter=adapter)


def ids(batch) -> list[str]:
    return [c.request.request_id for c in batch.chunks]


def test_a_third_adapter_waits_with_everyone_behind_it_and_runs_when_an_adapter_leaves():
    s = make(max_loras=2)
    x, y = req("x1", "x", max_tokens=3), req("y1", "y", max_tokens=12)
    s.add(x)
    s.add(y)
    batch = s.schedule()
    assert ids(batch) == ["x1", "y1"]
    advance(s, batch)
    z, base, x2 = req("z1", "z"), req("base", None), req("x2", "x")
    for r in (z, base, x2):
        s.add(r)
    for _ in range(2):  # x1 has two tokens to go: z1 waits, and the base request and x2 behind it wait too
        batch = s.schedule()
        assert ids(batch) == ["x1", "y1"]
        assert [r.request_id for r in s.waiting] == ["z1", "base", "x2"]
        assert all(r.status is RequestStatus.WAITING for r in (z, base, x2))
        advance(s, batch)
    assert x.request_id not in {r.request_id for r in s.running}  # x's last request has left
    batch = s.schedule()
    # z takes x's place; the base request behind it comes in (it adds no adapter); x2 would be a third: it waits
    assert ids(batch) == ["y1", "z1", "base"]
    assert [r.request_id for r in s.waiting] == ["x2"]
    assert len({c.request.adapter for c in batch.chunks} - {None}) == 2
    for _ in range(64):  # bounded: y1 and z1 end, then x2 runs
        if not s.waiting:
            break
        advance(s, batch)
        batch = s.schedule()
    assert "x2" in ids(batch) and not s.waiting


def test_requests_of_a_running_adapter_and_base_requests_are_not_held_back():
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
