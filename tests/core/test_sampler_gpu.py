"""The step's logits on a GPU: plain greedy rows decided by one argmax, the others copied to the host together."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.request import Request
from pagoda.core.sampler import Sampler, StepLogits
from pagoda.core.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _request(i: int, **params) -> Request:
    return Request(request_id=str(i), prompt_token_ids=[1, 2], sampling_params=SamplingParams(**params),
                   arrival_time=0.0)


def test_step_logits_match_sampling_each_row_on_the_host():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen, device="cuda")
    requests = [_request(0, temperature=0), _request(1, temperature=0.8, seed=1), _request(2, temperature=0),
                _request(3, temperature=0, logprobs=2), _request(4, temperature=0), _request(5, temperature=0.5, seed=3)]
    step = StepLogits(logits, requests)
    assert [t is not None for t in step.greedy] == [True, False, True, False, True, False]
    host = logits.cpu()
    for i in (0, 2, 4):
        assert step.greedy[i] == int(host[i].argmax())
    for i in (1, 3, 5):
        assert step.row(i).device.type == "cpu" and torch.equal(step.row(i), host[i])
    token = Sampler().sample_row(step.row(3), requests[3])  # greedy with logprobs: sampled on the host row
    assert token.token_id == int(host[3].argmax()) and len(token.top_logprobs) == 2
