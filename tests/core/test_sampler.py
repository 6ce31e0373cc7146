import math

import pytest
import torch

from pagoda.core.request import Request
from pagoda.core.sampler import Sampler
from pagoda.core.sampling_params import SamplingParams


def req(rid="r", output=(), prompt=(1, 2), **params):
    r = Request(rid, list(prompt), SamplingParams(**params))
    r.output_token_ids = list(output)
    return r


def draws(logits, n=400, **params):
    """The tokens one request samples over n steps (one private generator)."""
    r = req(seed=3, **params)
    sampler = Sampler()
    return [sampler.sample(logits[None], [r])[0].token_id for _ in range(n)]


LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]))


def test_greedy_is_argmax():
    out = Sampler().sample(torch.stack([LOGITS, LOGITS.flip(0)]), [req("a", temperature=0), req("b", temperature=0)])
    assert [s.token_id for s in out] == [1, 3]


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(LOGITS, top_k=2)) == {1, 2}
    assert set(draws(LOGITS, top_p=0.6)) == {1, 2}  # 0.4 < 0.6, so the token that crosses it stays
    assert set(draws(LOGITS, top_p=0.4)) == {1}
    assert set(draws(LOGITS, min_p=0.5)) == {1, 2}  # p >= 0.5 * 0.4
    assert set(draws(LOGITS)) == {0, 1, 2, 3, 4}  # and without them every token shows up


def test_a_request_stream_does_not_depend_on_the_batch():
    alone = [Sampler().sample(LOGITS[None], [req(seed=9)])[0].token_id]
    r = req(seed=9)
    others = [req(f"o{i}", seed=i) for i in range(5)]
    batch = torch.stack([LOGITS.roll(i) for i in range(5)] + [LOGITS])
    assert Sampler().sample(batch, others + [r])[-1].token_id == alone[0]


def test_seeded_streams_repeat_and_differ():
    assert draws(LOGITS, n=50) == draws(LOGITS, n=50)
    r1, r2 = req(seed=1), req(seed=2)
    s = Sampler()
    a = [s.sample(LOGITS[None], [r1])[0].token_id for _ in range(50)]
    b = [s.sample(LOGITS[None], [r2])[0].token_id for _ in range(50)]
    assert a != b


def test_penalties_and_logit_bias():
    flat = torch.zeros(5)
    assert Sampler().sample(flat[None], [req(temperature=0, logit_bias={4: 1.0})])[0].token_id == 4
    # token 1 appeared twice in the output: a frequency penalty pushes greedy elsewhere
    peaked = torch.tensor([0.0, 1.0, 0.9, 0.0, 0.0])
    assert Sampler().sample(peaked[None], [req(temperature=0, output=(1, 1), frequency_penalty=0.1)])[0].token_id == 2
    assert Sampler().sample(peaked[None], [req(temperature=0, output=(1,), presence_penalty=0.5)])[0].token_id == 2
    assert Sampler().sample(peaked[None], [req(temperature=0, prompt=(1,), repetition_penalty=1.5)])[0].token_id == 2
    assert torch.equal(peaked, torch.tensor([0.0, 1.0, 0.9, 0.0, 0.0]))  # the runner's logits are not modified


def test_logprobs_of_the_model_distribution():
    (s,) = Sampler().sample(LOGITS[None], [req(temperature=0, logprobs=2)])
    assert s.token_id == 1 and math.isclose(s.logprob, math.log(0.4), rel_tol=1e-5)
    assert [t for t, _ in s.top_logprobs] == [1, 2]
    assert math.isclose(s.top_logprobs[1][1], math.log(0.3), rel_tol=1e-5)
    (plain,) = Sampler().sample(LOGITS[None], [req(temperature=0)])
    assert plain.logprob is None and plain.top_logprobs is None


def test_a_vanishing_temperature_is_greedy_and_never_overflows():
    # found by tests/api/test_fuzz.py: 5e-324 divided the logits into inf and the probabilities into nan
    assert SamplingParams(temperature=5e-324).greedy and not SamplingParams(temperature=1e-3).greedy
    assert Sampler().sample(LOGITS[None], [req(temperature=5e-324)])[0].token_id == int(torch.argmax(LOGITS))


def test_a_penalty_that_overflows_the_logits_still_samples():
    prompt = tuple(range(LOGITS.shape[0]))
    for _ in range(20):
        token = Sampler().sample(LOGITS[None], [req(prompt=prompt, temperature=1.0, repetition_penalty=5e-324)])[0]
        assert 0 <= token.token_id < LOGITS.shape[0]


def test_a_vanishing_top_p_keeps_the_most_likely_token():
    # found by tests/api/test_fuzz.py: top_p=5e-324 is 0 in float32 and dropped every token
    assert set(draws(LOGITS, n=50, temperature=1.0, top_p=5e-324)) == {int(torch.argmax(LOGITS))}


def test_draws_follow_the_filtered_distribution():
    probs = torch.softmax(LOGITS, dim=-1)
    for params, support in ((dict(), [0, 1, 2, 3, 4]), (dict(top_k=3), [1, 2, 3]), (dict(top_p=0.8), [1, 2, 3])):
        tokens = draws(LOGITS, n=4000, **params)
        kept = probs[support] / probs[support].sum()
        for token_id, p in zip(support, kept.tolist()):
            assert abs(tokens.count(token_id) / len(tokens) - p) < 0.03, (params, token_id)
        assert set(tokens) == set(support)


def test_top_k_keeps_every_token_tied_with_the_kth():
    tied = torch.tensor([3.0, 2.0, 2.0, 0.0, 2.0])
    assert set(draws(tied, n=300, top_k=2)) == {0, 1, 2, 4}
    masked = torch.tensor([1.0, float("-inf"), float("-inf"), 0.5, float("-inf")])  # what a grammar leaves
    assert set(draws(masked, n=300, top_k=3)) == {0, 3}


def test_a_stream_carried_across_a_preemption_continues_where_it_stopped():
    whole = draws(LOGITS, n=40, top_k=4, temperature=0.9)
    r = req(seed=3, top_k=4, temperature=0.9)
    first = [Sampler().sample_row(LOGITS, r).token_id for _ in range(15)]
    resumed = Request("r", [1, 2], r.sampling_params)  # the same request, recomputed: its stream kept
    resumed.generator = r.generator
    assert first + [Sampler().sample_row(LOGITS, resumed).token_id for _ in range(25)] == whole


def test_negative_seeds_fold_to_their_64_bit_twin():
    twin = lambda seed: [Sampler().sample_row(LOGITS, r).token_id for r in [req(seed=seed)] for _ in range(30)]
    assert twin(-1) == twin(2**64 - 1) and twin(-1) != twin(1)


def test_sample_rows_batches_greedy_rows_and_keeps_a_failure_to_its_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[4] = float("nan")
    requests = [req(f"g{i}", temperature=0) for i in range(3)] + [req("s", seed=1), req("bad", seed=2),
                                                                  req("lp", temperature=0, logprobs=1)]
    out = Sampler().sample_rows(logits, requests)
    assert [t.token_id for t in out[:3]] == logits[:3].argmax(dim=-1).tolist()
    assert isinstance(out[4], ValueError) and 0 <= out[3].token_id < 50
    assert out[5].token_id == int(logits[5].argmax()) and out[5].top_logprobs[0][0] == out[5].token_id
    with pytest.raises(ValueError, match="no token has a finite logit"):
        Sampler().sample(logits[4:5], [req("bad", seed=2)])


def test_a_nucleus_wider_than_the_first_candidates_is_drawn_from_whole():
    ramp = torch.linspace(0.0, 1.0, 600)  # softly increasing: the 0.5 nucleus holds about 270 tokens
    probs = torch.softmax(ramp, dim=-1).sort(descending=True).values
    want = 1 + int((probs.cumsum(0)[:-1] < 0.5).sum())
    tokens = set(draws(ramp, n=3000, temperature=1.0, top_p=0.5))
    assert max(tokens) == 599 and len(tokens) > 200 and min(tokens) >= 600 - want
    assert set(draws(ramp, n=3000, temperature=1.0, min_p=0.9)) <= set(range(600 - 600 // 9, 600))
