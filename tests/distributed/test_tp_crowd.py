"""The acceptance crowd on the default model (tests/acceptance/test_default_crowd.py) at --tensor-parallel-size 2:
four clients that disagree, byte-identical to their solo runs under preemption, the pool whole after."""

import asyncio

import httpx
import pytest

from pagoda.harness.live_server import live_server
from tests.acceptance.test_default_crowd import (  # noqa: F401  (the test, collected again)
    test_default_model_crowd_is_byte_identical_to_solo_under_preemption,
)
from pagoda.harness.acceptance import compare_solo_and_crowd
from pagoda.harness.crowds import default_model_crowd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run(default_model_dir):
    with live_server(default_model_dir, "smollm2", num_blocks=8, block_size=16, max_running=4,
                     max_batched_tokens=256, max_model_len=2048, tensor_parallel_size=2) as live:
        assert httpx.get(live.url + "/health", timeout=60).json()["tensor_parallel"]["size"] == 2
        plans = default_model_crowd()
        yield (*(plans, *asyncio.run(compare_solo_and_crowd(live, plans))), "none", 0)  # float32, no step graphs
