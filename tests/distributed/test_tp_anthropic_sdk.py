"""The Anthropic SDK tests (tests/api/test_anthropic_sdk.py), every one, against a server at --tensor-parallel-size 2.

The tests are the single-process module's own, collected here again; only `tiny_server` differs: the same
tiny model and engine, served by two ranks over gloo (this process and a spawned one).
"""

import pytest

from tests.api.test_anthropic_sdk import *  # noqa: F401,F403  (the tests and their fixtures, collected again)
from tests.distributed.helpers import test_the_server_runs_on_two_ranks, tiny_server  # noqa: F401

pytestmark = pytest.mark.slow
