"""The acceptance crowd on the tiny random model: 12 clients, 3 running slots, a pool that must preempt.

The crowd speaks every protocol the server registers (the four built-in ones, and the Ollama example's two
when its plugin is installed), each streaming and unary.

Pool size: measured (docs/acceptance.md). With 3 running slots and answers of 40 tokens, the chat-style
prompts (~40 tokens with the chat template) need up to 5 blocks of 16 each, so three at once want up to
15. Measured: 8 blocks -> 6 preemptions, 263 positions recomputed; 10 -> 6 and 262; 12 and 16 -> none
(the short completions prompts leave room); with the Ollama example's protocols too, 8 blocks -> 6 and 288.
8 blocks still hold the largest single request (5 blocks).
"""

import asyncio

import pytest

from pagoda.harness.acceptance import (
    check_answers,
    check_pool_returned,
    check_prediction,
    check_survivors,
    predict_in_simulator,
    run_crowd,
    run_solo,
)
from pagoda.harness.crowds import tiny_crowd, with_hangups
from pagoda.harness.live_server import live_server
from pagoda.core.engine_config import EngineConfig

TINY_POOL = EngineConfig(num_blocks=8, block_size=16, max_running=3, max_batched_tokens=256, max_model_len=1024)


@pytest.fixture(scope="module")
def crowd_server(tiny_model_dir):
    c = TINY_POOL
    with live_server(tiny_model_dir, "tiny-random", num_blocks=c.num_blocks, block_size=c.block_size,
                     max_running=c.max_running, max_batched_tokens=c.max_batched_tokens,
                     max_model_len=c.max_model_len) as live:
        yield live


@pytest.fixture(scope="module")
def tiny_run(crowd_server):
    """Solo pass, then the crowd with three clients hanging up half-way."""
    async def run():
        plans = tiny_crowd(list(crowd_server.endpoints))
        solo = await run_solo(crowd_server.url, plans, crowd_server.model_name, crowd_server.endpoints)
        plans = with_hangups(plans, solo)
        crowd = await run_crowd(crowd_server.url, plans, crowd_server.model_name, crowd_server.endpoints)
        await asyncio.wait_for(crowd_server.async_engine.wait_until_idle(), 60)
        return plans, solo, crowd

    return asyncio.run(run())


def test_the_crowd_was_hard(tiny_run, crowd_server):
    plans, solo, crowd = tiny_run
    summary = crowd.summary()
    print(summary)
    assert len(plans) == max(12, 2 * len(crowd_server.endpoints)) and summary["peak_active"] > 3  # more clients than slots
    assert crowd.peak_running > 1  # requests overlapped in the engine
    assert crowd.recomputed_tokens > 0 and crowd.preemptions > 0  # the pool forced preemption
    assert summary["hung_up"] == 3


def test_every_completed_answer_is_byte_identical_to_its_solo_run(tiny_run):
    plans, solo, crowd = tiny_run
    assert all(o.status == "completed" and o.text for o in solo.values())
    assert check_answers(solo, crowd) == len(plans) - 3


def test_the_crowd_speaks_every_registered_protocol_both_ways(tiny_run, crowd_server):
    plans, solo, crowd = tiny_run
    assert {"completions", "chat", "responses", "messages"} <= set(crowd_server.endpoints)
    assert {(p.protocol, p.stream) for p in plans} == {(name, s) for name in crowd_server.endpoints for s in (False, True)}


def test_survivors_completed_with_the_right_finish_reason(tiny_run):
    plans, solo, crowd = tiny_run
    check_survivors(plans, crowd)


def test_the_pool_came_back(tiny_run, crowd_server):
    stats = asyncio.run(check_pool_returned(crowd_server.url, crowd_server.async_engine.audit))
    assert stats["aborted_total"] >= 3  # the three that hung up were aborted, not run to the end


def test_the_simulator_predicts_who_completed(tiny_run):
    plans, solo, crowd = tiny_run
    prediction = predict_in_simulator(plans, solo, TINY_POOL, crowd.seconds_per_step)
    assert prediction.ok
    check_prediction(prediction, crowd)


def test_a_crowd_of_one_does_not_pass_for_hard(crowd_server):
    """The difficulty checks are not vacuous: one client alone neither overlaps nor preempts."""
    async def run():
        plan = tiny_crowd(list(crowd_server.endpoints))[4]
        return await run_crowd(crowd_server.url, [plan], crowd_server.model_name, crowd_server.endpoints)

    crowd = asyncio.run(run())
    assert crowd.peak_running <= 1 and crowd.preemptions == 0
