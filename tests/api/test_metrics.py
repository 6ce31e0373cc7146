"""Metrics.observe and the engine collector, driven with hand-made outputs (no server, no engine)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api.metrics import AccessRecord, Metrics
from pagoda.core.async_engine import GenerationError, RequestAborted
from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason

STATS = {"running": 2, "waiting": 1, "kv_blocks_total": 8, "kv_blocks_free": 6, "preemptions_total": 3,
         "recomputed_tokens_total": 40, "requests_total": 9, "aborted_total": 1, "kv_blocks_cached_free": 4,
         "prefix_cache_queried_tokens_total": 300, "prefix_cache_hit_tokens_total": 96}


def output(n_out: int, new: list[int], finished: bool = False) -> AnswerDelta:
    return AnswerDelta("r", new, "x" * len(new), finished, FinishReason.STOP if finished else None,
                         num_prompt_tokens=5, num_output_tokens=n_out)


async def outputs_of(items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def samples(metrics: Metrics, stats: dict | None = None) -> dict[tuple[str, tuple], float]:
    text = metrics.render(stats or {}).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def consume(metrics: Metrics, items, record: AccessRecord) -> list[AnswerDelta]:
    async def go():
        return [out async for out in metrics.observe(outputs_of(items), record)]
    return asyncio.run(go())


def test_a_finished_request_is_timed_and_counted():
    metrics, record = Metrics(), AccessRecord()
    seen = consume(metrics, [output(1, [7]), output(2, [8]), output(3, [9], finished=True)], record)
    assert [o.new_token_ids for o in seen] == [[7], [8], [9]]  # passed through unchanged, in order
    s = samples(metrics)
    assert s[("pagoda_time_to_first_token_seconds_count", ())] == 1
    assert s[("pagoda_inter_token_latency_seconds_count", ())] == 2
    assert s[("pagoda_e2e_request_latency_seconds_count", ())] == 1
    assert s[("pagoda_prompt_tokens_total", ())] == 5
    assert s[("pagoda_generation_tokens_total", ())] == 3
    assert s[("pagoda_requests_finished_total", (("reason", "stop"),))] == 1
    assert (record.prompt_tokens, record.completion_tokens, record.abort_reason) == (5, 3, None)


@pytest.mark.parametrize(("failure", "reason"), [(RequestAborted("shutdown"), "server"),
                                                 (GenerationError("boom"), "model_error")])
def test_a_request_ended_by_the_server_is_an_abort_with_its_reason(failure, reason):
    metrics, record = Metrics(), AccessRecord()
    with pytest.raises(type(failure)):
        consume(metrics, [output(1, [7]), failure], record)
    assert samples(metrics)[("pagoda_requests_aborted_total", (("reason", reason),))] == 1
    assert record.abort_reason == reason


def test_a_cancelled_request_takes_its_clients_reason_and_a_refusal_is_not_an_abort():
    metrics, record = Metrics(), AccessRecord()
    metrics.client_left(record, "client_disconnect")
    metrics.client_left(record, "send_stall")  # only the first departure counts

    async def cancel_midway():
        stream = metrics.observe(outputs_of([output(1, [7]), output(2, [8])]), record)
        await stream.__anext__()
        await stream.aclose()  # what the job's cancellation does to it
    asyncio.run(cancel_midway())
    with pytest.raises(ValueError):  # admission refused it: nothing was generated, nothing aborted
        consume(metrics, [ValueError("prompt too long")], AccessRecord())
    s = samples(metrics)
    assert s[("pagoda_requests_aborted_total", (("reason", "client_disconnect"),))] == 1
    assert s[("pagoda_client_departures_total", (("reason", "client_disconnect"),))] == 1
    assert ("pagoda_client_departures_total", (("reason", "send_stall"),)) not in s
    assert not any(name == "pagoda_requests_aborted_total" and labels != (("reason", "client_disconnect"),)
                   for name, labels in s)


def test_the_engine_gauges_come_from_the_stats_of_the_scrape():
    metrics = Metrics()
    assert ("pagoda_requests_running", ()) not in samples(metrics)  # no stats: no engine numbers invented
    s = samples(metrics, STATS)
    assert s[("pagoda_requests_running", ())] == 2 and s[("pagoda_requests_waiting", ())] == 1
    assert s[("pagoda_kv_cache_usage_ratio", ())] == pytest.approx(0.25)
    assert s[("pagoda_preemptions_total", ())] == 3 and s[("pagoda_recomputed_tokens_total", ())] == 40
    assert s[("pagoda_prefix_cache_queries_tokens_total", ())] == 300
    assert s[("pagoda_prefix_cache_hits_tokens_total", ())] == 96 and s[("pagoda_kv_blocks_cached_free", ())] == 4
