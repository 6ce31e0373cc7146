"""The acceptance crowd with constrained clients on every protocol, on the default model: under preemption each
answer is byte-identical to the same client alone, and every constrained answer validates against its schema."""

import asyncio
import importlib.util

import pytest

from pagoda.harness.acceptance import check_answers, compare_solo_and_crowd
from pagoda.harness.constrained_crowds import PROTOCOLS, check_constrained, constrained_crowd
from pagoda.harness.live_server import live_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="constrained decoding needs xgrammar"),
]


@pytest.fixture(scope="module")
def constrained_run(default_model_dir):
    with live_server(default_model_dir, "smollm2", num_blocks=10, block_size=16, max_running=4,
                     max_batched_tokens=256, max_model_len=2048) as live:
        plans = constrained_crowd()
        yield (plans, *asyncio.run(compare_solo_and_crowd(live, plans)))


def test_constrained_clients_match_solo_and_validate_on_every_protocol(constrained_run):
    plans, solo, crowd, stats = constrained_run
    print(crowd.summary(), {cid: o.text for cid, o in crowd.outcomes.items()})
    assert all(o.status == "completed" for o in crowd.outcomes.values()), crowd.outcomes
    assert crowd.peak_running > 1 and crowd.preemptions > 0 and crowd.recomputed_tokens > 0  # it was hard
    assert check_answers(solo, crowd) == len(plans)
    assert check_constrained(plans, solo) == len(PROTOCOLS)  # the solo answers validate too, on their own
    assert check_constrained(plans, crowd.outcomes) == len(PROTOCOLS)
    assert crowd.peak_running > 1 and crowd.preemptions > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
