"""The engine's LoRA adapters, on the simulator's fake model: the adapter is part of the prefix cache's key, an
unload waits for the adapter's last request, and loads and requests naming adapters are checked."""

from __future__ import annotations

import pytest

from pagoda.core.adapters import AdapterError, AdapterInfo, UnknownAdapter
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from tests.helpers import drain, tokens

PROMPT = list(range(1, 13))  # three 4-token blocks
GREEDY = SamplingParams(max_tokens=6, temperature=0)


class SpyRunner(FakeModelRunner):
    """The fake model, noting each unload it is asked for."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.unloaded: list[str] = []

    def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)
        super().unload_adapter(name)


def engine_with(*adapters: str, num_blocks: int = 32) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_running=4, max_batched_tokens=64,
                          max_model_len=128, max_loras=2)
    runner = SpyRunner(num_blocks, 4, vocab_size=64, eos_bias=-50.0)  # EOS never wins
    engine = Engine(runner, config, eos_token_ids=(EOS_TOKEN_ID,))
    for name in adapters:
        engine.load_adapter(name, f"/adapters/{name}")
    return engine


def run_one(engine: Engine, rid: str, adapter: str | None, params: SamplingParams = GREEDY) -> list:
    engine.add_request(rid, PROMPT, params, adapter=adapter)
    return drain(engine)[rid]


def test_the_adapter_is_part_of_the_prefix_cache_key():
    engine = engine_with("x", "y")
    hits = []
    answers = {}
    for rid, adapter in (("x1", "x"), ("y1", "y"), ("base1", None), ("x2", "x"), ("base2", None)):
        outs = run_one(engine, rid, adapter)
        answers[rid] = tokens(outs)
        hits.append((rid, outs[-1].num_cached_tokens, engine.stats()["prefix_cache_hit_tokens_total"]))
        engine.audit()
    # no hit across adapters or between an adapter and the base; the same adapter (or the base) again hits its
    # cached blocks (the whole prompt's: all but its last block, whose last token is recomputed)
    assert hits == [("x1", 0, 0), ("y1", 0, 0), ("base1", 0, 0), ("x2", 8, 8), ("base2", 8, 16)]
    assert answers["x1"] == answers["x2"] and answers["base1"] == answers["base2"]
    assert len({tuple(answers[r]) for r in ("x1", "y1", "base1")}) == 3  # each adapter answers its own way


def test_an_unload_waits_for_the_adapters_last_request_and_refuses_new_ones_meanwhile():
    engine = engine_with("x", "y")
    engine.add_request("long", PROMPT, SamplingParams(max_tokens=8, temperature=0), adapter="x")
    engine.add_request("short", PROMPT, SamplingParams(max_tokens=3, temperature=0), adapter="x")
    engine.add_request("other", PROMPT, GREEDY, adapter="y")
    engine.step()
    assert engine.stats()["lora_adapters_in_use"] == 2
    future = engine.unload_adapter("x")
    assert not future.done()
    with pytest.raises(UnknownAdapter, match="'x' is not loaded"):  # at once: a new request may not name it
        engine.add_request("late", PROMPT, GREEDY, adapter="x")
    assert "late" not in engine.requests and "x" not in engine.adapters.snapshot
    ended: set[str] = set()
    for _ in range(100):  # bounded: the requests have at most 8 tokens to make
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                ended.add(out.request_id)
        engine.audit()
        # the future is done exactly when x's last request ("long") has ended, and the runner unloaded it then
        assert future.done() == ("long" in ended)
        assert engine.runner.unloaded == (["x"] if "long" in ended else [])
    assert ended == {"long", "short", "other"} and future.done()
    info = future.result()
    assert isinstance(info, AdapterInfo) and info.name == "x" and info.path == "/adapters/x"
    assert "x" not in engine.runner.adapters and "x" not in engine.adapters.loaded
    engine.audit()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert (stats["lora_adapters_loaded"], stats["lora_adapters_in_use"]) == (1, 0)
    assert stats["lora_adapter_bytes"] == engine.adapters.loaded["y"].nbytes > 0
    with pytest.raises(UnknownAdapter):
        engine.add_request("after", PROMPT, GREEDY, adapter="x")
    run_one(engine, "y2", "y")  # the other adapter serves on


def test_an_unload_with_nothing_in_flight_is_done_at_once_and_an_abort_can_end_the_last_user():
    engine = engine_with("x", "y")
    assert engine.unload_adapter("y").done() and engine.runner.unloaded == ["y"]
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, temperature=0), adapter="x")
    engine.step()
    future = engine.unload_adapter("x")
    engine.abort("a")
    assert not future.done()
    (out,) = engine.step()
    assert out.finish_reason is FinishReason.ABORT and future.done() and engine.runner.unloaded == ["y", "x"]
    engine.audit()
    assert engine.stats()["lora_adapters_loaded"] == 0
    with pytest.raises(UnknownAdapter):
        engine.unload_adapter("x")


def test_a_name_loaded_twice_is_refused_naming_lora_name():
    engine = engine_with("x")
    with pytest.raises(AdapterError, match="'x' is already loaded") as caught:
        engine.load_adapter("x", "/elsewhere")
    assert caught.value.field == "lora_name"
    assert engine.adapters.loaded["x"].path == "/adapters/x"  # the first load stands


def test_a_request_naming_an_adapter_not_loaded_is_refused():
    engine = engine_with("x")
    with pytest.raises(UnknownAdapter, match=r"'nope' is not loaded \(loaded: 'x'\)") as caught:
        engine.add_request("a", PROMPT, GREEDY, adapter="nope")
    assert caught.value.field == "model"
    assert not engine.has_unfinished() and engine.stats()["requests_total"] == 0
    engine.audit()
