"""The acceptance crowd with the prefix cache on: a shared instruction text and multi-turn conversations.

The solo pass runs every plan alone under a cache salt of its own, so it never reads the cache; the crowd
runs with no salt, so its clients share the instruction blocks and each follow-up finds its conversation's
earlier turns. Every completed answer must still be byte-identical to its solo run, under preemption.

Pool size: measured (docs/acceptance.md). First turns are ~85 prompt tokens with the chat template (55
without) and answers run to 24, so one request wants up to 7 blocks of 16 and a third turn ~12; 4 running at
once want more than the 20 blocks here even when they share the instruction blocks, so the crowd preempts
(measured: 5 preemptions, 556 positions recomputed, 1,184 of 1,961 looked-up prompt tokens hit), while a third
turn still fits alone.
"""

import asyncio

import pytest

from pagoda.core.engine_config import EngineConfig
from pagoda.harness.acceptance import check_answers, check_pool_returned, check_survivors, run_crowd, run_solo
from pagoda.harness.live_server import live_server
from pagoda.harness.prefix_crowds import default_model_prefix_crowd, predicted_hit_tokens, shared_prefix_chat_crowd

POOL = EngineConfig(num_blocks=20, block_size=16, max_running=4, max_batched_tokens=256, max_model_len=1024)
PROTOCOLS = ["completions", "chat", "responses", "messages"]


@pytest.fixture(scope="module")
def prefix_run(tiny_model_dir):
    c = POOL
    with live_server(tiny_model_dir, "tiny-random", num_blocks=c.num_blocks, block_size=c.block_size,
                     max_running=c.max_running, max_batched_tokens=c.max_batched_tokens,
                     max_model_len=c.max_model_len) as live:
        async def run():
            plans = shared_prefix_chat_crowd(PROTOCOLS)
            solo = await run_solo(live.url, plans, live.model_name, live.endpoints)
            solo_hits = live.health()["prefix_cache_hit_tokens_total"]
            crowd = await run_crowd(live.url, plans, live.model_name, live.endpoints)
            await asyncio.wait_for(live.async_engine.wait_until_idle(), 60)
            stats = await check_pool_returned(live.url, live.async_engine.audit)
            return plans, solo, solo_hits, crowd, stats

        yield asyncio.run(run())


def test_the_solo_pass_never_read_the_cache(prefix_run):
    plans, solo, solo_hits, crowd, stats = prefix_run
    assert solo_hits == 0 and all(o.cached_tokens == 0 for o in solo.values())
    assert all(o.status == "completed" and o.text for o in solo.values())


def test_every_completed_answer_is_byte_identical_to_its_solo_run_under_preemption(prefix_run):
    plans, solo, solo_hits, crowd, stats = prefix_run
    print(crowd.summary())
    assert crowd.preemptions > 0 and crowd.recomputed_tokens > 0 and crowd.peak_running > 1
    check_survivors(plans, crowd)
    assert check_answers(solo, crowd) == len(plans)


def test_follow_ups_sent_the_conversation_so_far(prefix_run):
    plans, solo, solo_hits, crowd, stats = prefix_run
    third = crowd.outcomes["p0-t2"]
    assert [user for user, _ in third.conversation][:2] == [plans[0].prompt_text, "Tell me more."]
    assert third.conversation[0][1] == crowd.outcomes["p0-t0"].text  # the answer the first turn got
    assert solo["p0-t2"].prompt_tokens > solo["p0-t1"].prompt_tokens > solo["p0-t0"].prompt_tokens


def test_the_crowd_hit_the_cache_at_least_as_its_shape_predicts(prefix_run):
    plans, solo, solo_hits, crowd, stats = prefix_run
    completed = {cid for cid, o in crowd.outcomes.items() if o.status == "completed"}
    predicted = predicted_hit_tokens(plans, completed, POOL.block_size)
    assert predicted > 0 and crowd.prefix_hit_tokens >= predicted
    reported = sum(o.cached_tokens or 0 for o in crowd.outcomes.values())
    assert 0 < reported <= crowd.prefix_hit_tokens  # what usage told the clients (a resume can hit again)
    assert stats["prefix_cache_hit_tokens_total"] == solo_hits + crowd.prefix_hit_tokens


@pytest.mark.slow
def test_default_model_crowd_shares_prefixes_and_matches_solo_under_preemption(default_model_dir):
    """Four clients on the default model: three behind the shared instructions, then a second turn.

    Pool: 11 blocks hold the second turn alone (~160 slots); the three first turns (~85, ~85 and 55 prompt tokens,
    32 each out) want more (measured: 1 preemption, 112 positions recomputed, 240 of 468 prompt tokens hit).
    """
    with live_server(default_model_dir, "smollm2", num_blocks=11, block_size=16, max_running=4,
                     max_batched_tokens=256, max_model_len=2048) as live:
        async def run():
            plans = default_model_prefix_crowd()
            solo = await run_solo(live.url, plans, live.model_name, live.endpoints)
            crowd = await run_crowd(live.url, plans, live.model_name, live.endpoints)
            await asyncio.wait_for(live.async_engine.wait_until_idle(), 60)
            await check_pool_returned(live.url, live.async_engine.audit)
            return plans, solo, crowd

        plans, solo, crowd = asyncio.run(run())
    print(crowd.summary())
    assert all(o.cached_tokens == 0 for o in solo.values())
    assert crowd.preemptions > 0 and crowd.peak_running > 1
    check_survivors(plans, crowd)
    assert check_answers(solo, crowd) == len(plans)
    completed = {cid for cid, o in crowd.outcomes.items() if o.status == "completed"}
    assert crowd.prefix_hit_tokens >= predicted_hit_tokens(plans, completed, 16) > 0
