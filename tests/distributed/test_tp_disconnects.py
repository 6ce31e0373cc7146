"""The disconnect matrix (tests/disconnect/test_paths.py: every path, stream and unary, hangs up mid-decode and
its work ends) against a one-slot server at --tensor-parallel-size 2."""

import httpx
import pytest

from tests.disconnect.helpers import ONE_SLOT_ENGINE, start_live
from tests.disconnect.test_paths import (  # noqa: F401  (the tests and their fixtures, collected again)
    access_log,
    test_a_client_that_hangs_up_mid_decode_ends_its_work,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir):
    live = start_live(tiny_model_dir, "one-slot", tensor_parallel_size=2, **ONE_SLOT_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def test_the_server_runs_on_two_ranks(one_slot_server):
    assert httpx.get(one_slot_server.url + "/health", timeout=60).json()["tensor_parallel"]["size"] == 2
