"""core/speculative.py and its use by the scheduler and engine: n-gram drafts in the padded rows.

The engine tests run a fake model whose greedy continuation mostly repeats the
context with period 3 (so drafts are accepted) and sometimes breaks it (so they
are rejected); it reads every context back through the block table, so a draft
slot left stale, or a ledger mistake, changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core import speculative
from pagoda.core.batch import RunnerOutput
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.fake_model import FakeModelRunner
from tests.helpers import drain, tokens

VOCAB = 64
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def naive_propose(tokens, k, lookup_max, lookup_min):
    """The definition, spelled out: the longest suffix n-gram's earliest earlier start, and what followed."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_propose_finds_the_longest_match_and_its_continuation():
    assert speculative.propose([1, 2, 3, 9, 1, 2, 3], 3, 4, 1) == [9, 1, 2]
    assert speculative.propose([5, 2, 3, 7, 1, 2, 3], 2, 4, 1) == [7, 1]  # "2 3" matched, not just "3"
    assert speculative.propose([1, 2, 3, 4], 3, 4, 1) == []  # the suffix "4" never occurred before
    assert speculative.propose([7, 7, 7], 5, 4, 1) == [7]  # overlapping the suffix, cut at the end
    assert speculative.propose([1, 2, 1, 3, 1], 2, 4, 2) == []  # "3 1" never occurred; "1" alone is too short
    assert speculative.propose([1], 3, 4, 1) == [] and speculative.propose([1, 1], 0, 4, 1) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_propose_equals_the_definition(tokens, k, lookup_max, below):
    lookup_min = max(1, lookup_max - below)
    drafts = speculative.propose(tokens, k, lookup_max, lookup_min)
    assert drafts == naive_propose(tokens, k, lookup_max, lookup_min)
    assert len(drafts) <= k


def test_only_greedy_unconstrained_requests_speculate_and_never_past_max_tokens():
    spec = SpeculativeConfig(num_speculative_tokens=3)
    repetitive = [1, 2, 3] * 4
    req = Request("a", repetitive, SamplingParams(max_tokens=10, temperature=0))
    assert speculative.drafts_for(req, spec, 3, 1000) == [1, 2, 3]
    assert speculative.drafts_for(req, spec, 2, 1000) == [1, 2]  # the padded rows left
    req.output_token_ids = [1] * 8  # two tokens to go: one draft and its bonus
    assert len(speculative.drafts_for(req, spec, 3, 1000)) == 1
    assert speculative.drafts_for(req, spec, 3, len(req.all_token_ids) + 1) == []  # the context's end
    sampled = Request("b", repetitive, SamplingParams(max_tokens=10, temperature=0.7, seed=1))
    assert speculative.drafts_for(sampled, spec, 3, 1000) == []


def test_speculative_config_parses_vllm_json_and_names_bad_fields():
    parsed = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert parsed == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert SpeculativeConfig.parse("{}") is None and SpeculativeConfig.parse("none") is None
    for text, field in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"prompt_lookup_min": 5}', "prompt_lookup_min"), ('{"draft": 1}', "draft"), ("[1]", "object")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(text)
    assert EngineConfig().speculative == SpeculativeConfig()  # on by default: it only fills padded rows


class PeriodicRunner(FakeModelRunner):
    """Greedy continuation = the token 3 back, except where the context's checksum says otherwise."""

    def execute(self, batch):
        for chunk in batch.chunks:
            self._write(chunk.block_table, chunk.start, chunk.token_ids)
        rows = []
        for chunk in batch.sample_chunks:
            for end in range(chunk.end, chunk.end + chunk.num_logits_rows):
                context = self._read(chunk.block_table, end)
                assert min(context) >= 0, "read a slot never written"
                nxt = context[-3] if len(context) >= 3 and sum(context) % 5 else (sum(context) * 7 + 1) % VOCAB
                row = torch.zeros(VOCAB)
                row[nxt] = 1.0
                rows.append(row)
        return RunnerOutput(logits=torch.stack(rows) if rows else torch.empty(0, VOCAB))


def periodic_engine(spec, num_blocks=64, max_running=4, **kw):
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_running=max_running, max_batched_tokens=64,
                          max_model_len=256, speculative=spec, **kw)
    return Engine(PeriodicRunner(num_blocks, 4, vocab_size=VOCAB), config)


def run_jobs(engine, jobs):
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    return {rid: tokens(outs) for rid, outs in drain(engine).items()}  # drain audits after every step


JOBS = [(f"r{i}", [3 + i, 10 + 2 * i, 20 + i, 4] * (1 + i % 3), GREEDY) for i in range(6)]


@pytest.mark.parametrize("max_running", [1, 3])
def test_greedy_tokens_are_the_same_with_drafts_and_drafts_are_accepted(max_running):
    plain_engine = periodic_engine(None, max_running=max_running)
    plain = run_jobs(plain_engine, JOBS)
    engine = periodic_engine(SpeculativeConfig(), max_running=max_running)
    assert run_jobs(engine, JOBS) == plain
    stats = engine.stats()
    assert stats["spec_decode_accepted_tokens_total"] > 0
    assert stats["spec_decode_draft_tokens_total"] > stats["spec_decode_accepted_tokens_total"]  # some rejected
    assert stats["steps_total"] < plain_engine.stats()["steps_total"]  # accepted drafts are steps saved
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def hand_steps(engine, jobs, limit=200):
    """Each step's batch, yielded before it runs: the engine stepped by hand (schedule, run, advance, sample),
    audited after every step."""
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        batch = engine.scheduler.schedule()
        yield batch
        logits = engine.runner.execute(batch).logits
        engine._advance(batch, 0.0)
        engine._collect(batch, logits)
        engine.audit()


def test_drafts_only_fill_rows_the_padding_would_waste():
    engine = periodic_engine(SpeculativeConfig(num_speculative_tokens=8), max_running=4)
    seen = 0
    for batch in hand_steps(engine, JOBS[:3]):
        own = sum(c.num_tokens for c in batch.chunks)
        rows = own + batch.num_draft_tokens
        assert -(-rows // 4) == -(-own // 4), "drafts made the step bigger"
        sampling = len(batch.sample_chunks)
        assert -(-(sampling + batch.num_draft_tokens) // 4) == -(-sampling // 4), "drafts grew the LM head's rows"
        seen += batch.num_draft_tokens
    assert seen > 0 and not engine.has_unfinished()


def unpadded() -> PeriodicRunner:
    """The same model on a runner that pads nothing (int8/int4 weights, CUDA): no row is spare."""
    return PeriodicRunner(64, 4, vocab_size=VOCAB, row_multiple=1)


def test_the_setting_and_the_runners_row_multiple_decide_what_runs_and_say_why():
    assert not speculative.in_force(None, 4).active
    assert "--speculative-config is empty" in speculative.in_force(None, 4).reason
    off = speculative.in_force(SpeculativeConfig(), 1)
    assert not off.active and "pads no rows" in off.reason and "max_extra_rows is 0" in off.reason
    on = speculative.in_force(SpeculativeConfig(), 4)
    assert on.active and "multiple of 4" in on.reason
    extra = speculative.in_force(SpeculativeConfig(max_extra_rows=2), 1)
    assert extra.active and "up to 2 more rows a step" in extra.reason
    assert extra.describe() == {"active": True, "reason": extra.reason, "method": "ngram",
                                "num_speculative_tokens": 3, "max_extra_rows": 2}


def test_a_runner_that_pads_nothing_runs_drafts_only_in_the_extra_rows_the_setting_allows():
    config = dict(num_blocks=64, block_size=4, max_running=4, max_batched_tokens=64, max_model_len=256)
    plain = run_jobs(Engine(unpadded(), EngineConfig(**config, speculative=None)), JOBS)
    quiet = Engine(unpadded(), EngineConfig(**config))  # the default: padded rows only
    assert not quiet.speculation.active and run_jobs(quiet, JOBS) == plain
    assert quiet.stats()["spec_decode_draft_tokens_total"] == 0  # off, and said so: not "on" and silently idle
    wide = Engine(unpadded(), EngineConfig(**config, speculative=SpeculativeConfig(max_extra_rows=3)))
    assert wide.speculation.active and run_jobs(wide, JOBS) == plain
    assert wide.stats()["spec_decode_accepted_tokens_total"] > 0


def test_extra_rows_bound_how_much_a_step_may_grow():
    engine = periodic_engine(SpeculativeConfig(num_speculative_tokens=8, max_extra_rows=2), max_running=4)
    grew = 0
    for batch in hand_steps(engine, JOBS[:3]):
        own = sum(c.num_tokens for c in batch.chunks)
        assert batch.num_draft_tokens <= -own % 4 + 2, "drafts took more than the padding and the extra rows"
        grew += batch.num_draft_tokens > -own % 4
    assert grew > 0 and not engine.has_unfinished()


def test_stops_inside_an_accepted_run_end_the_request_there():
    prompt = [5, 6, 7] * 4
    stop_at = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[7])
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    jobs = [("stop", prompt, stop_at), ("short", prompt + [5], short)]
    plain = run_jobs(periodic_engine(None), jobs)
    engine = periodic_engine(SpeculativeConfig())
    assert run_jobs(engine, jobs) == plain
    assert plain["stop"][-1] == 7 and len(plain["short"]) == 5
    assert engine.stats()["spec_decode_draft_tokens_total"] > 0


def test_a_preempted_speculating_request_resumes_with_the_same_tokens():
    jobs = [(f"p{i}", [9 + i, 30 + i, 2] * 3, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
            for i in range(4)]
    alone = {rid: run_jobs(periodic_engine(None), [(rid, p, s)])[rid] for rid, p, s in jobs}
    engine = periodic_engine(SpeculativeConfig(), num_blocks=24, max_running=4)
    assert run_jobs(engine, jobs) == alone
    assert engine.stats()["preemptions_total"] > 0, "the pool was never short: the test proved nothing"
    assert engine.stats()["spec_decode_accepted_tokens_total"] > 0


def test_penalties_and_logprobs_see_the_plain_decodes_tokens_row_by_row():
    # a penalty reads the output so far: each draft row must be sampled after the tokens before it are appended
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=0.4, logprobs=2)
    prompt = [8, 9, 10] * 4

    def run(spec):
        engine = periodic_engine(spec)
        engine.add_request("a", prompt, params)
        outs = drain(engine)["a"]
        return tokens(outs), [lp for o in outs for lp in o.logprobs], engine.stats()

    plain_tokens, plain_logprobs, _ = run(None)
    spec_tokens, spec_logprobs, stats = run(SpeculativeConfig())
    assert spec_tokens == plain_tokens and spec_logprobs == plain_logprobs
    assert len(spec_logprobs) == 30 and stats["spec_decode_accepted_tokens_total"] > 0
