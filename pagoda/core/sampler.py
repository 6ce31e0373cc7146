"""Per-request sampling from the runner's logits.

Each request owns a torch.Generator seeded from its `seed` (or from a fresh
random seed), kept on the request itself. A request's token therefore depends
only on its own logits row and its own random stream: not on which other rows
share the batch, and not on whether it was preempted and recomputed (the
generator advances only when a token is actually sampled). Every row is
processed on its own 1-D tensor so no reduction is shaped by the batch.
"""

from __future__ import annotations

import secrets

import torch

from pagoda.core.outputs import SampledToken
from pagoda.core.request import Request


class Sampler:
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Pick one token per row; logits [len(requests), vocab] float32."""
        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        return [self.sample_row(logits[i], request) for i, request in enumerate(requests)]

    def sample_row(self, row: torch.Tensor, request: Request) -> SampledToken:
        """One request's token from its own logits row [vocab]; whatever raises here is that request's alone."""
        params = request.sampling_params
        logprobs = torch.log_softmax(row, dim=-1) if params.logprobs is not None else None  # the model's own
        if request.grammar is not None:  # a copy with what its grammar forbids next at -inf
            row = request.grammar.mask(row)
        if params.has_penalties:
            row = _apply_penalties(row.clone(), request)
        if params.greedy:
            token_id = int(torch.argmax(row))
        else:
            token_id = int(torch.multinomial(_probs(row, params), 1, generator=_generator(request)))
        if request.grammar is not None:
            request.grammar.accept(token_id)
        if logprobs is None:
            return SampledToken(token_id)
        top = ()
        if params.logprobs:
            values, ids = torch.topk(logprobs, params.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        return SampledToken(token_id, float(logprobs[token_id]), top)


def _generator(request: Request) -> torch.Generator:
    if request.generator is None:
        seed = request.sampling_params.seed
        request.generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    return request.generator


def _probs(row: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns probabilities [vocab]."""
    # A logit a penalty pushed past float range is the largest finite one, so softmax never sees inf - inf.
    row = torch.nan_to_num(row / params.temperature, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
    if 0 < params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_row, order = torch.sort(row, descending=True)
        sorted_probs = torch.softmax(sorted_row, dim=-1)
        # Drop a token when the tokens before it already reach top_p: the one that crosses it stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop[0] = False  # the most likely token always stays (a top_p below float32's range rounds to 0)
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def _apply_penalties(row: torch.Tensor, request: Request) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, and logit bias."""
    params = request.sampling_params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
        ids, counts = torch.tensor(request.output_token_ids, dtype=torch.long).unique(return_counts=True)
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
    for token_id, bias in params.logit_bias.items():
        if 0 <= token_id < row.shape[0]:
            row[token_id] += bias
    return row
