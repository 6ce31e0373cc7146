import pytest

from pagoda.core.batch import RunnerOutput
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import KVCacheExhausted
from tests.helpers import drain, fake_engine, tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def test_generates_to_max_tokens_and_frees_the_pool():
    engine = fake_engine()
    engine.add_request("a", [1, 2, 3], GREEDY)
    outs = drain(engine)["a"]
    assert len(tokens(outs)) == 6
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 6 and outs[-1].num_prompt_tokens == 3
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["generated_tokens_total"], stats["requests_total"]) == (0, 0, 6, 1)


def test_abort_is_applied_at_the_top_of_the_next_step():
    engine = fake_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.block_manager.block_table("a")
    engine.abort("a")
    engine.abort("nobody")  # unknown ids are a no-op
    assert engine.block_manager.block_table("a")  # marked, not yet applied
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
    assert engine.stats()["aborted_total"] == 1 and not engine.has_unfinished()
    engine.audit()


def test_abort_of_a_waiting_request():
    engine = fake_engine(max_running=1)
    engine.add_request("a", [1, 2], GREEDY)
    engine.add_request("b", [1, 2], GREEDY)
    engine.step()
    engine.abort("b")
    outs = drain(engine)
    assert outs["b"][0].finish_reason is FinishReason.ABORT
    assert outs["a"][-1].num_output_tokens == 6 and outs["a"][-1].finish_reason is FinishReason.LENGTH


def test_stop_token_and_eos_and_ignore_eos():
    engine = fake_engine()
    engine.add_request("probe", [1, 2, 3], GREEDY)
    first = tokens(drain(engine)["probe"])
    second_token = first[1]
    engine.add_request("stop", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(second_token,)))
    outs = drain(engine)["stop"]
    assert tokens(outs) == first[:2] and outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].stop_reason == second_token
    eos_engine = fake_engine()
    eos_engine.eos_token_ids = frozenset({second_token})
    eos_engine.add_request("eos", [1, 2, 3], GREEDY)
    eos_engine.add_request("ignore", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = drain(eos_engine)
    assert tokens(outs["eos"]) == first[:2] and outs["eos"][-1].finish_reason is FinishReason.STOP
    assert outs["eos"][-1].stop_reason is None
    assert tokens(outs["ignore"]) == first


def test_admission_errors_leave_nothing_behind():
    engine = fake_engine(num_blocks=2, block_size=4)
    with pytest.raises(KVCacheExhausted):
        engine.add_request("a", [1] * 8, GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("b", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", [1, 64], GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("d", [1], SamplingParams(stop=("x",)))
    engine.add_request("e", [1], GREEDY)
    with pytest.raises(ValueError, match="already live"):
        engine.add_request("e", [1], GREEDY)
    assert list(engine.requests) == ["e"] and engine.stats()["requests_total"] == 1


def test_a_failed_model_step_fails_its_requests_and_the_engine_keeps_serving():
    engine = fake_engine()
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch) -> RunnerOutput:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_execute(batch)

    engine.runner.execute = flaky
    engine.add_request("a", [1, 2, 3], GREEDY)
    outs = drain(engine)["a"]
    assert outs[-1].finish_reason is FinishReason.ERROR and "device fell over" in outs[-1].error
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
    engine.add_request("b", [1, 2, 3], GREEDY)
    assert drain(engine)["b"][-1].finish_reason is FinishReason.LENGTH


def test_seeded_sampling_is_private_to_the_request():
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = fake_engine()
    alone.add_request("x", [5, 6, 7], params)
    solo = tokens(drain(alone)["x"])
    crowd = fake_engine(num_blocks=64)
    for i in range(5):
        crowd.add_request(f"o{i}", [i + 1] * (i + 2), SamplingParams(max_tokens=9, temperature=1.0, seed=i))
    crowd.add_request("x", [5, 6, 7], params)
    assert tokens(drain(crowd)["x"]) == solo


def test_preempted_request_continues_exactly_as_alone():
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=s) for s in range(4)]
    prompts = [[i + 1] * (3 + i) for i in range(4)]
    solo = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine = fake_engine(num_blocks=32)
        engine.add_request(str(i), prompt, p)
        solo.append(tokens(drain(engine)[str(i)]))
    tight = fake_engine(num_blocks=8, block_size=4)  # 32 slots for ~4 x 25: must preempt
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tight.add_request(str(i), prompt, p)
    outs = drain(tight)
    assert tight.stats()["preemptions_total"] > 0 and tight.stats()["recomputed_tokens_total"] > 0
    assert [tokens(outs[str(i)]) for i in range(4)] == solo


class ScriptedRunner:
    """Emits a fixed token sequence: the token at output position i is script[i]."""

    row_multiple = 1  # pads nothing

    def __init__(self, script, vocab_size):
        self.script, self.vocab_size = script, vocab_size

    def execute(self, batch):
        import torch

        rows = []
        for chunk in batch.sample_chunks:
            row = torch.zeros(self.vocab_size)
            row[self.script[chunk.request.num_output_tokens]] = 10.0
            rows.append(row)
        return RunnerOutput(logits=torch.stack(rows))


def test_stop_string_across_tokens_ends_with_text_before_it(default_tokenizer):
    from pagoda.core.engine_config import EngineConfig
    from pagoda.core.engine import Engine

    tok = default_tokenizer
    script = tok.encode("The answer is forty-two. Done here.", add_special_tokens=False)
    engine = Engine(ScriptedRunner(script, tok.vocab_size), EngineConfig(num_blocks=8, block_size=16), tokenizer=tok)
    engine.add_request("a", tok.encode("Q", add_special_tokens=False), SamplingParams(max_tokens=30, temperature=0, stop=("two. D",)))
    outs = drain(engine)["a"]
    text = "".join(o.new_text for o in outs)
    assert text == "The answer is forty-"
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == "two. D"
    assert len(tokens(outs)) < len(script)  # it stopped early, mid-script
    engine.add_request("b", [1], SamplingParams(max_tokens=len(script), temperature=0))
    outs = drain(engine)["b"]
    assert "".join(o.new_text for o in outs) == tok.decode(script) and outs[-1].finish_reason is FinishReason.LENGTH


def test_a_shared_prefix_is_computed_once_and_reported():
    engine = fake_engine(num_blocks=16, block_size=4)
    system = list(range(1, 13))  # three full blocks
    engine.add_request("first", system + [20], GREEDY)
    engine.step()  # first's prompt is computed; its blocks join the cache at the next step
    engine.add_request("second", system + [30, 31], GREEDY, tenant="t")  # another tenant: no hit
    engine.add_request("third", system + [30, 31], GREEDY)
    outs = drain(engine)
    assert outs["first"][-1].num_cached_tokens == 0 and outs["second"][-1].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 12 for o in outs["third"])
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens_total"] == 12
    assert stats["prefix_cache_queried_tokens_total"] == 13 + 14 + 14
    assert stats["kv_blocks_free"] == engine.config.num_blocks and stats["kv_blocks_cached_free"] > 0
    alone = fake_engine(num_blocks=16, block_size=4, enable_prefix_caching=False)
    alone.add_request("third", system + [30, 31], GREEDY)
    assert tokens(drain(alone)["third"]) == tokens(outs["third"])


def test_a_sampling_failure_fails_that_request_alone():
    from tests.helpers import FaultySampler

    solo = fake_engine()
    solo.add_request("b", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0))
    alone = tokens(drain(solo)["b"])

    engine = fake_engine()
    engine.sampler = FaultySampler(engine.sampler, lambda r: r.request_id == "bad" and r.num_output_tokens == 2)
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0.7, seed=3))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0))
    outs = drain(engine)
    assert outs["bad"][-1].finish_reason is FinishReason.ERROR and "injected" in outs["bad"][-1].error
    assert len(tokens(outs["bad"])) == 2
    assert tokens(outs["b"]) == alone and outs["b"][-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
    assert engine.stats()["failed_total"] == 1


def test_token_ids_in_the_params_must_be_in_the_vocabulary():
    engine = fake_engine()
    with pytest.raises(ValueError, match="logit_bias token id 64 is outside the vocabulary"):
        engine.add_request("a", [1], SamplingParams(logit_bias={64: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("a", [1], SamplingParams(stop_token_ids=(10_000,)))
    assert not engine.requests


SCORE = SamplingParams(max_tokens=0, prompt_logprobs=2)


def test_prompt_logprobs_score_every_position_whatever_the_chunks():
    """Prompt token i is scored by the row at position i - 1: the same entries whole or in chunks of 3 tokens; the
    first has no logprob; max_tokens 0 generates nothing, and the pool comes back whole."""
    prompt = [5, 9, 2, 33, 7, 7, 41, 18, 3, 60, 12]
    scored = {}
    for budget in (64, 3):
        engine = fake_engine(max_batched_tokens=budget)
        engine.add_request("s", prompt, SCORE)
        (out,) = drain(engine)["s"]
        assert out.finished and out.finish_reason is FinishReason.LENGTH and out.new_token_ids == []
        assert engine.block_manager.num_free_blocks == engine.config.num_blocks
        assert engine.stats()["generated_tokens_total"] == 0
        scored[budget] = out.prompt_logprobs
    entries = scored[64]
    assert [t.token_id for t in entries] == prompt and entries[0].logprob is None
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 and t.rank >= 1 for t in entries[1:])
    assert all(t.rank == 1 or t.logprob < t.top_logprobs[0][1] for t in entries[1:])
    assert scored[3] == entries, "chunking changed the prompt logprobs"


def test_prompt_logprobs_come_with_the_first_output_and_skip_the_prefix_cache():
    engine = fake_engine(num_blocks=16, block_size=4)
    system = list(range(1, 13))  # three full blocks
    engine.add_request("writer", system + [20], GREEDY)
    drain(engine)
    engine.add_request("reader", system + [20], GREEDY)  # the cache holds the prefix ...
    engine.add_request("scorer", system + [20], SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0))
    outs = drain(engine)
    assert outs["reader"][-1].num_cached_tokens == 12
    assert outs["scorer"][-1].num_cached_tokens == 0  # ... which a scoring request does not read
    firsts = [o for o in outs["scorer"] if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is outs["scorer"][0] and firsts[0].new_token_ids
    assert len(firsts[0].prompt_logprobs) == 13 and all(t.top_logprobs == () for t in firsts[0].prompt_logprobs[1:])
    assert tokens(outs["scorer"]) == tokens(outs["reader"])
    alone = fake_engine(num_blocks=16, block_size=4, enable_prefix_caching=False)
    alone.add_request("scorer", system + [20], SCORE)
    assert [t.logprob for t in drain(alone)["scorer"][0].prompt_logprobs] == \
        [t.logprob for t in firsts[0].prompt_logprobs]


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21)
