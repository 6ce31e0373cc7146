"""The route table: what the router knows of each path, read from the plugins the replicas load."""

from __future__ import annotations

import pytest

from pagoda.plugins.client import ClientError, line_data
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.manager import load_plugins
from pagoda.plugins.protocol import ApiError
from pagoda.router.routes import UNKNOWN_PATH, RouteTable
from tests.disconnect.helpers import ENDPOINTS, PLUGINS_ENV

TABLE = RouteTable.from_plugins(load_plugins(PLUGINS_ENV))


@pytest.mark.parametrize("protocol", sorted(ENDPOINTS))
def test_each_endpoint_has_its_protocol_shape_and_framing_and_is_guarded(protocol):
    endpoint = ENDPOINTS[protocol]
    info = TABLE.lookup(endpoint.path)
    assert (info.protocol, info.errors, info.stream_format, info.guarded) == (
        protocol, endpoint.errors, endpoint.stream_format, True)


@pytest.mark.parametrize("protocol", sorted(ENDPOINTS))
def test_a_stream_error_is_the_protocols_own_event_and_its_client_half_reports_it(protocol):
    info = TABLE.lookup(ENDPOINTS[protocol].path)
    wire = info.stream_error(ApiError(502, "the replica at http://r failed mid-stream: ReadError"))
    assert wire.endswith(info.event_end)
    answer = ENDPOINTS[protocol].client_answer()
    with pytest.raises(ClientError, match="failed mid-stream"):
        for line in wire.decode().splitlines():
            data = line_data(info.stream_format, line)
            if data is not None:
                answer.event(data)


def test_plugin_routes_keep_their_shape_and_guard_and_unknown_paths_are_left_to_the_replica():
    assert TABLE.lookup("/v1/messages/count_tokens").errors is ENDPOINTS["messages"].errors
    assert TABLE.lookup("/tokenize").guarded and TABLE.lookup("/tokenize").errors is OPENAI_ERRORS
    assert TABLE.lookup("/v1/models/tiny-random").guarded  # a path parameter
    assert TABLE.lookup("/v1/models/a/b") is UNKNOWN_PATH  # one segment only
    assert not TABLE.lookup("/").guarded  # the chat page is open, as on pagoda
    assert TABLE.lookup("/v1/nothing-here") is UNKNOWN_PATH and not UNKNOWN_PATH.guarded
    assert UNKNOWN_PATH.errors is OPENAI_ERRORS and UNKNOWN_PATH.stream_error(ApiError(502, "x")) == b""


def test_the_responses_error_event_numbers_on_from_the_events_already_relayed():
    info = TABLE.lookup(ENDPOINTS["responses"].path)
    wire = info.stream_error(ApiError(502, "gone"), num_events=7).decode()
    data = [line_data("sse", line) for line in wire.splitlines() if line.startswith("data:")]
    assert [(d["type"], d["sequence_number"]) for d in data] == [("error", 7)]
