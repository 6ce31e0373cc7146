"""The server side of the split that `pagoda bench serve` reads: engine stamps, /metrics histograms, the means."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api.metrics import AccessRecord, Metrics
from pagoda.bench.serve.client import split_means
from pagoda.core.outputs import AnswerDelta, RequestTimes
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from tests.helpers import drain, fake_engine


def test_a_finished_request_carries_ordered_engine_stamps():
    engine = fake_engine(max_running=1)
    for rid in ("a", "b"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    outs = drain(engine)
    for rid in ("a", "b"):
        assert all(o.times is None for o in outs[rid][:-1])  # only the last output carries them
        t = outs[rid][-1].times
        assert t.arrival <= t.scheduled <= t.first_token <= t.finished
        assert t.queue_seconds >= 0 and t.prefill_seconds >= 0 and t.decode_seconds >= 0
    # max_running=1: b waited for the whole of a, so it was first scheduled after a had finished
    assert outs["b"][-1].times.scheduled >= outs["a"][-1].times.finished


def test_an_aborted_waiting_request_has_no_split():
    engine = fake_engine(max_running=1)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", [1, 2], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.abort("b")
    (out,) = [o for o in engine.step() if o.request_id == "b"]
    assert out.finish_reason is FinishReason.ABORT
    assert (out.times.scheduled, out.times.queue_seconds, out.times.decode_seconds) == (None, None, None)


def _histograms(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render({}).decode()) for s in f.samples
            if s.name.startswith("pagoda_request_") and not s.name.endswith("_bucket")}


def test_metrics_observe_the_split_when_a_request_finishes():
    times = RequestTimes(arrival=10.0, scheduled=10.5, first_token=11.25, finished=13.0)
    outs = [AnswerDelta("r", [7], "a", False, None, 5, 1),
            AnswerDelta("r", [8], "b", True, FinishReason.LENGTH, 5, 2, times=times)]

    async def consume():
        async def gen():
            for o in outs:
                yield o
        return [o async for o in metrics.observe(gen(), AccessRecord())]

    metrics = Metrics()
    assert len(asyncio.run(consume())) == 2
    h = _histograms(metrics)
    assert h["pagoda_request_queue_seconds_count"] == h["pagoda_request_decode_seconds_count"] == 1
    assert (h["pagoda_request_queue_seconds_sum"], h["pagoda_request_prefill_seconds_sum"],
            h["pagoda_request_decode_seconds_sum"]) == pytest.approx((0.5, 0.75, 1.75))


def test_split_means_are_per_request_between_two_scrapes():
    before = {"queue": (1.0, 2.0), "prefill": (2.0, 2.0), "decode": (4.0, 2.0)}
    after = {"queue": (1.5, 4.0), "prefill": (3.0, 4.0), "decode": (10.0, 4.0)}
    assert split_means(before, after) == {"queue": 0.25, "prefill": 0.5, "decode": 3.0}
    assert split_means(before, before) == {"queue": None, "prefill": None, "decode": None}
    assert split_means(None, after) is None  # not a pagoda: no histograms


def test_metrics_observe_the_hops_between_the_event_loop_and_the_engine_thread():
    import time

    async def consume():
        async def gen():
            t0 = time.monotonic()  # after observe's own start: the handler submitted before this
            times = RequestTimes(arrival=t0 + 0.25, scheduled=t0 + 0.5, first_token=t0 - 1.0, finished=t0 + 2.0)
            yield AnswerDelta("r", [7], "a", False, None, 5, 1)
            yield AnswerDelta("r", [8], "b", True, FinishReason.LENGTH, 5, 2, times=times)
        return [o async for o in metrics.observe(gen(), AccessRecord())]

    metrics = Metrics()
    asyncio.run(consume())
    h = _histograms(metrics)
    assert h["pagoda_request_handoff_seconds_count"] == h["pagoda_request_first_token_delivery_seconds_count"] == 1
    assert h["pagoda_request_handoff_seconds_sum"] == pytest.approx(0.25, abs=0.05)  # arrival - submitted
    assert h["pagoda_request_first_token_delivery_seconds_sum"] == pytest.approx(1.0, abs=0.05)  # reached - stamped
    before = {k: (0.0, 0.0) for k in ("queue", "prefill", "decode", "handoff", "first_token_delivery")}
    after = {**before, "queue": (1.0, 2.0), "handoff": (0.5, 2.0), "first_token_delivery": (0.25, 2.0)}
    assert split_means(before, after)["handoff"] == 0.25 and split_means(before, after)["first_token_delivery"] == 0.125
