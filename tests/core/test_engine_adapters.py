"""The engine's LoRA adapters, on the simulator's fake model: the adapter (its load) is part of the prefix cache's
key, an unload waits for the adapter's last request however it ends and answers the runner's failure to its own
waiters, and loads (prepared apart, installed on the engine's thread) and requests naming adapters are checked."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pagoda.core.adapters import AdapterError, AdapterInfo, AdapterTable, UnknownAdapter
from pagoda.core.batch import RunnerLost
from pagoda.core.constraint import Constraint
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from tests.core.test_grammar import tiny_tokenizer
from tests.helpers import drain, tokens

PROMPT = list(range(1, 13))  # three 4-token blocks
GREEDY = SamplingParams(max_tokens=6, temperature=0)


class SpyRunner(FakeModelRunner):
    """The fake model, noting each unload it is asked for."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.unloaded: list[str] = []
        self.unload_error: BaseException | None = None  # raised after the unload (a group's broadcast failing)

    def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)
        super().unload_adapter(name)
        if self.unload_error is not None:
            raise self.unload_error


def engine_with(*adapters: str, num_blocks: int = 32, tokenizer=None) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_running=4, max_batched_tokens=64,
                          max_model_len=128, max_loras=2)
    runner = SpyRunner(num_blocks, 4, vocab_size=64, eos_bias=-50.0)  # EOS never wins
    engine = Engine(runner, config, eos_token_ids=(EOS_TOKEN_ID,), tokenizer=tokenizer)
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


def test_a_name_unloaded_and_loaded_again_from_elsewhere_answers_as_the_new_adapter_with_no_cache_hit():
    engine = engine_with("x")
    first = run_one(engine, "first", "x")
    again = run_one(engine, "again", "x")
    assert again[-1].num_cached_tokens == 8 and tokens(again) == tokens(first)  # the same load: its blocks serve
    assert engine.unload_adapter("x").done()
    assert engine.load_adapter("x", "/retrained/x").path == "/retrained/x"
    reloaded = run_one(engine, "reloaded", "x")
    # the blocks the first load computed are still cached, under its key: the new load's requests never hit them
    assert reloaded[-1].num_cached_tokens == 0
    fresh = engine_with()
    fresh.load_adapter("x", "/retrained/x")
    assert tokens(reloaded) == tokens(run_one(fresh, "fresh", "x")) != tokens(first)
    engine.add_request("keyed", PROMPT, GREEDY, adapter="x")
    assert (engine.requests["keyed"].adapter, engine.requests["keyed"].adapter_key) == ("x", "x#2")
    assert drain(engine)["keyed"][-1].num_cached_tokens == 8  # the new load's own blocks serve it
    engine.audit()


def test_cache_keys_are_the_name_first_and_never_given_twice():
    table = AdapterTable()

    def load(name: str) -> str:
        table.add(AdapterInfo(name, f"/{name}", 8, 1))
        return table.keys[name]

    def unload(name: str) -> None:
        future, now = table.begin_unload(name)
        assert now
        table.remove(name)
        assert future.result().name == name

    assert load("x#2") == "x#2" and load("x") == "x"  # first loads: the name, as the router hashes it
    unload("x")
    assert load("x") == "x#3"  # "x#2" is another adapter's
    unload("x")
    unload("x#2")
    assert load("x") == "x#4" and load("x#2") == "x#2#2"
    assert len(table.issued) == 5


def test_an_unload_that_fails_in_the_runner_answers_its_waiters_and_fails_no_request():
    engine = engine_with("x", "y")
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3, temperature=0), adapter="x")
    engine.step()
    future = engine.unload_adapter("x")
    engine.runner.unload_error = RuntimeError("the group's broadcast failed")
    outs = drain(engine)
    assert outs["a"][-1].finish_reason is FinishReason.LENGTH and outs["a"][-1].error is None  # its whole answer
    assert isinstance(future.exception(timeout=0), RuntimeError) and "broadcast" in str(future.exception(timeout=0))
    assert "x" not in engine.adapters.loaded and engine.stats()["failed_total"] == 0  # forgotten all the same
    engine.runner.unload_error = None
    engine.load_adapter("x", "/adapters/x")  # the name is free again
    run_one(engine, "b", "x")
    engine.audit()


def test_a_runner_lost_while_unloading_ends_the_step_after_answering_the_waiters():
    engine = engine_with("x")
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0), adapter="x")
    engine.step()
    future = engine.unload_adapter("x")
    engine.runner.unload_error = RunnerLost("rank 1 is gone")
    with pytest.raises(RunnerLost):
        for _ in range(10):  # bounded: "a" has one token to go
            engine.step()
    assert isinstance(future.exception(timeout=0), RunnerLost) and "x" not in engine.adapters.loaded


def test_a_load_is_prepared_apart_and_its_install_checks_the_name_again():
    engine = engine_with()
    first = engine.prepare_adapter("x", "/adapters/x")
    second = engine.prepare_adapter("x", "/other/x")  # a second load of the name, prepared at the same time
    assert engine.adapters.loaded == {} and engine.runner.adapters == {}  # preparing touches neither
    assert engine.install_adapter(first).path == "/adapters/x"
    with pytest.raises(AdapterError, match="'x' is already loaded") as caught:
        engine.install_adapter(second)
    assert caught.value.field == "lora_name" and engine.adapters.loaded["x"].path == "/adapters/x"
    with pytest.raises(AdapterError, match="'x' is already loaded"):  # the quick refusal, before any reading
        engine.prepare_adapter("x", "/third/x")


@pytest.mark.parametrize("ending", ["finish", "abort", "compile failure"])
def test_a_request_waiting_for_its_grammar_holds_its_adapter_until_it_ends_however_it_ends(ending):
    engine = engine_with("x", tokenizer=tiny_tokenizer())
    constraint = Constraint("regex", "[a-z]{3}")
    compiled = engine.compile_constraint(constraint).result(timeout=60)
    held: Future = Future()
    engine.compile_constraint = lambda c: held  # the compile is still running
    engine.add_request("c", [1, 2], SamplingParams(max_tokens=8, temperature=0, constraint=constraint), adapter="x")
    engine.step()
    assert len(engine.compiling) == 1 and engine.adapters.users["x"] == 1
    future = engine.unload_adapter("x")
    engine.step()
    assert not future.done() and engine.runner.unloaded == []  # it waits for "c", which has not even started
    if ending == "abort":
        engine.abort("c")
    elif ending == "compile failure":
        held.set_exception(ValueError("the grammar compiler gave up"))
    else:
        held.set_result(compiled)
    outs = drain(engine)["c"]
    expected = {"finish": FinishReason.STOP, "abort": FinishReason.ABORT, "compile failure": FinishReason.ERROR}
    assert outs[-1].finish_reason is expected[ending]
    if ending == "finish":  # its grammar's answer, made with the adapter
        text = "".join(o.new_text for o in outs)
        assert len(text) == 3 and text.isalpha() and text.islower()
    assert future.result(timeout=0).name == "x" and engine.runner.unloaded == ["x"]
    assert engine.adapters.users == {} and len(engine.compiling) == 0
    engine.audit()
    engine.grammars.shutdown()
