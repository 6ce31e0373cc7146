"""A constrained job on every path (each endpoint, stream and not) is ended by its client leaving, like any other:
aborted mid-JSON, its grammar and blocks let go, the pool whole."""

import importlib.util

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.client import ClientRequest
from tests.disconnect.helpers import (
    ENDPOINTS,
    EVERY_PATH,
    PATHS,
    PROMPT,
    RawClient,
    new_request,
    one_slot_server,  # noqa: F401  (a fixture)
    wait_for,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="constrained decoding needs xgrammar")

ASKED = 800
HANGUP_AT = 20  # tokens generated when the client leaves: the request is mid-JSON
FAR_FEWER = ASKED // 5
# An answer that cannot end early: the grammar needs hundreds of items before it may close the array.
LONG_JSON = {"type": "array", "items": {"type": "integer"}, "minItems": 400}
# The built-in protocols send a client's schema in their own field; an installed example plugin may take none.
CONSTRAINED_PATHS = [(p, stream) for p, stream in EVERY_PATH if p in ("completions", "chat", "responses", "messages")]
PATH_IDS = [f"{protocol}-{'stream' if stream else 'unary'}" for protocol, stream in CONSTRAINED_PATHS]


@pytest.mark.parametrize(("protocol", "stream"), CONSTRAINED_PATHS, ids=PATH_IDS)
def test_a_constrained_job_ends_when_its_client_hangs_up(one_slot_server, protocol, stream):  # noqa: F811
    live = one_slot_server
    before = live.assert_pool_whole()
    ask = ClientRequest(PROMPT, ASKED, stream=stream, temperature=0.0, ignore_eos=True, model="m", json_schema=LONG_JSON)
    client = RawClient(live.url).post(PATHS[protocol], ENDPOINTS[protocol].client_request(ask))
    request = new_request(live)
    assert request.sampling_params.constraint is not None and request.sampling_params.constraint.kind == "json_schema"
    wait_for(lambda: request.num_output_tokens >= HANGUP_AT, "the constrained request to be decoding")
    client.close()
    wait_for(lambda: request.finish_reason is not None, "the constrained request to end")
    assert request.finish_reason is FinishReason.ABORT and request.num_output_tokens < FAR_FEWER
    after = live.assert_pool_whole()  # idle, audited, every block back
    assert after["aborted_total"] == before["aborted_total"] + 1
