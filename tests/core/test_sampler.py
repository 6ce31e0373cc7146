import math

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
