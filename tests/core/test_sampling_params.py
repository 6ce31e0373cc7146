import pytest

from pagoda.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[5, 6])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert not p.has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70, -(2**70), True])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63), -1])
def test_every_64_bit_seed_seeds_a_generator(seed):
    from pagoda.core.request import Request
    from pagoda.core.sampler import Sampler
    import torch

    request = Request(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(seed=seed, temperature=1.0))
    assert 0 <= Sampler().sample_row(torch.zeros(8), request).token_id < 8
