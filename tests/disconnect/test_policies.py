"""Disconnect policies: the built-in "finish", and a third-party one installed through an entry point."""

import asyncio
import sys
import textwrap

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.disconnect_abort import AbortOnDisconnect
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.builtin.disconnect_finish import FinishOnDisconnect
from pagoda.plugins.manager import collect_disconnect_policies, describe_plugins, load_plugins
from tests.disconnect.helpers import (
    ONE_SLOT_ENGINE,
    PATHS,
    RawClient,
    access_log,  # noqa: F401  (a fixture)
    metric_values,
    new_request,
    request_body,
    start_live,
    wait_for,
)


@pytest.fixture(scope="module")
def finish_server(tiny_model_dir):
    live = start_live(tiny_model_dir, "finish", settings={"disconnect_policy": "finish"}, **ONE_SLOT_ENGINE)
    yield live
    live.server.stop()


@pytest.mark.parametrize(("protocol", "stream"), [("chat", False), ("responses", True)])
def test_finish_lets_the_generation_complete_and_still_logs_499(finish_server, access_log, protocol,  # noqa: F811
                                                                stream):
    live = finish_server
    before = live.assert_pool_whole()
    departures = metric_values(live.url).get("pagoda_client_departures_total{reason=client_disconnect}", 0)
    client = RawClient(live.url).post(PATHS[protocol], request_body(protocol, max_tokens=120, stream=stream))
    request = new_request(live)
    wait_for(lambda: request.num_output_tokens >= 10, "the request to be decoding")
    at_close = request.num_output_tokens
    client.close()

    wait_for(lambda: any(r.status == 499 and r.path == PATHS[protocol] for r in access_log()), "the 499 line")
    assert at_close < 120 and request.finish_reason is FinishReason.LENGTH and request.num_output_tokens == 120
    line = next(r for r in access_log() if r.status == 499)
    assert line.reason == "client_disconnect" and line.completion_tokens == 120  # logged once the work was done
    after = live.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"]  # nothing was aborted
    values = metric_values(live.url)
    assert values["pagoda_client_departures_total{reason=client_disconnect}"] == departures + 1
    assert values.get("pagoda_requests_aborted_total{reason=client_disconnect}", 0) == 0


def test_the_built_in_policies_keep_the_configured_stall_deadline():
    for policy in (AbortOnDisconnect(), FinishOnDisconnect()):
        assert policy.send_stall_timeout(2.0) == 2.0

    class Patient(DisconnectPolicy):
        name = "patient"

        def send_stall_timeout(self, configured):
            return None  # never cut off a slow reader

    assert Patient().send_stall_timeout(2.0) is None


def test_abort_cancels_at_once_and_finish_waits_for_the_job():
    async def main():
        release = asyncio.Event()

        async def generation():
            await release.wait()
            return "done"

        job = asyncio.ensure_future(generation())
        await AbortOnDisconnect().client_gone(job, "client_disconnect")
        assert job.cancelled()

        job = asyncio.ensure_future(generation())
        waiting = asyncio.ensure_future(FinishOnDisconnect().client_gone(job, "send_stall"))
        await asyncio.sleep(0)
        assert not waiting.done()  # the generation is not finished: the policy waits
        release.set()
        await waiting
        assert job.result() == "done"

    asyncio.run(asyncio.wait_for(main(), 30))


# -- a policy from another package ---------------------------------------------------------------------
SHRUG = '''
    """A disconnect policy that does nothing at all: the server still ends the work."""
    from pagoda.plugins import hookimpl
    from pagoda.plugins.disconnect import DisconnectPolicy

    SEEN = []


    class Shrug(DisconnectPolicy):
        name = "shrug"

        async def client_gone(self, job, reason):
            SEEN.append((reason, job.done()))


    @hookimpl
    def pagoda_register_disconnect_policies(register):
        register(Shrug())
'''


@pytest.fixture
def shrug_installed(tmp_path, monkeypatch):
    """A distribution 'pagoda-shrug' declaring an entry point in the group 'pagoda', as pip would install it."""
    (tmp_path / "pagoda_shrug.py").write_text(textwrap.dedent(SHRUG))
    dist = tmp_path / "pagoda_shrug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pagoda-shrug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pagoda]\nshrug = pagoda_shrug\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("pagoda_shrug", None)


def test_a_policy_installed_by_entry_point_is_chosen_by_name_and_cannot_leave_work_running(
        shrug_installed, tiny_model_dir, access_log):  # noqa: F811
    pm = load_plugins({"PAGODA_PLUGINS": "shrug"})
    assert "shrug" in collect_disconnect_policies(pm)
    assert {i.name: i.origin for i in describe_plugins(pm)}["shrug"] == "pagoda-shrug 0.1"

    live = start_live(tiny_model_dir, "shrug", settings={"disconnect_policy": "shrug"},
                      environ={"PAGODA_PLUGINS": "shrug"}, **ONE_SLOT_ENGINE)
    try:
        before = live.assert_pool_whole()
        client = RawClient(live.url).post(PATHS["messages"], request_body("messages", max_tokens=800, stream=False))
        request = new_request(live)
        wait_for(lambda: request.num_output_tokens >= 10, "the request to be decoding")
        client.close()
        wait_for(lambda: request.is_finished, "the request to end")
        assert request.finish_reason is FinishReason.ABORT and request.num_output_tokens < 800
        assert sys.modules["pagoda_shrug"].SEEN == [("client_disconnect", False)]  # called while the job ran
        after = live.assert_pool_whole()
        assert after["aborted_total"] == before["aborted_total"] + 1
    finally:
        live.server.stop()
