"""The acceptance crowd over HTTP with LoRA adapters: the tiny model serving three peft-made adapters, the crowd's
conversations spread over the base and each adapter, on every protocol, streaming and unary, in a pool that must
preempt and with at most two adapters a step: every surviving answer is byte-identical to its solo run, and the
pool comes back whole.
"""

import asyncio

import pytest

from pagoda.harness.acceptance import check_answers, check_pool_returned, check_survivors, run_crowd, run_solo
from pagoda.harness.crowds import tiny_crowd, with_hangups
from pagoda.harness.live_server import live_server
from pagoda.simulator.crowd import with_adapters
from tests.lora_files import hf_model, save_random_adapter

pytest.importorskip("peft")

ADAPTERS = ("a", "b", "c")


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    hf = hf_model(tiny_model_dir)
    modules = tuple((name, str(save_random_adapter(hf, out / name, rank=8, seed=i, std=0.1)))
                    for i, name in enumerate(ADAPTERS))
    with live_server(tiny_model_dir, "tiny-random", num_blocks=8, block_size=16, max_running=3,
                     max_batched_tokens=256, max_model_len=1024, lora_modules=modules, max_loras=2) as live:
        yield live


def count_adapters_per_step(engine):
    """The most distinct adapters any step of `engine` carried, counted from here on (a list of one number)."""
    peak, execute = [0], engine.runner.execute

    def counting(batch):
        peak[0] = max(peak[0], len({c.request.adapter for c in batch.chunks} - {None}))
        return execute(batch)

    engine.runner.execute = counting  # an instance attribute, set before the crowd's first step
    return peak


@pytest.fixture(scope="module")
def lora_run(lora_server):
    async def run():
        plans = with_adapters(tiny_crowd(list(lora_server.endpoints)), ADAPTERS)
        solo = await run_solo(lora_server.url, plans, lora_server.model_name, lora_server.endpoints)
        plans = with_hangups(plans, solo)
        before = await lora_server.async_engine.stats()
        before["peak_step_adapters"] = count_adapters_per_step(lora_server.async_engine.engine)
        crowd = await run_crowd(lora_server.url, plans, lora_server.model_name, lora_server.endpoints)
        await asyncio.wait_for(lora_server.async_engine.wait_until_idle(), 60)
        return plans, solo, crowd, before, await lora_server.async_engine.stats()

    return asyncio.run(run())


def test_the_crowd_was_hard_and_mixed(lora_run):
    plans, solo, crowd, before, after = lora_run
    assert {p.adapter for p in plans} == {None, *ADAPTERS}
    summary = crowd.summary()
    assert summary["peak_active"] > 3  # more clients than running slots
    assert after["preemptions_total"] > before["preemptions_total"], "nothing was preempted: the test proved less"
    assert before["peak_step_adapters"] == [2], "no step carried two adapters (max_loras): the test proved less"


def test_each_adapter_answers_its_own(lora_server):
    client = lora_server.openai()
    answers = {name: client.completions.create(model=name or "tiny-random", prompt="Once upon a time", max_tokens=12,
                                               temperature=0).choices[0].text for name in (None, *ADAPTERS)}
    assert len(set(answers.values())) == 1 + len(ADAPTERS), answers


def test_every_answer_is_its_solo_answer_byte_for_byte(lora_run):
    plans, solo, crowd, _, _ = lora_run
    check_survivors(plans, crowd)
    assert check_answers(solo, crowd) > 0


def test_the_pool_comes_back_whole(lora_run, lora_server):
    asyncio.run(check_pool_returned(lora_server.url, lora_server.async_engine.audit))
    assert lora_server.health()["lora_adapters_in_use"] == 0
