"""Per-request sampling from the runner's logits.

Each request owns a random stream (a `random.Random` seeded from its `seed`,
or from a fresh random seed), kept on the request itself. A request's token
therefore depends only on its own logits row and its own stream: not on which
other rows share the batch, and not on whether it was preempted and recomputed
(the stream advances only when a token is actually sampled). Every row is
processed on its own 1-D tensor so no reduction is shaped by the batch.

A sampled token costs one uniform from the stream, drawn by inverse CDF over
the candidates that survive top-k, top-p and min-p: `topk` hands the most
likely tokens to Python as a short sorted list, where the filters and the draw
are a few list operations (`torch.multinomial` paid an exponential per
vocabulary entry, its own validation and a tensor op per filter step). With no
filter the draw runs on the whole row's CDF tensor. Plain greedy rows of a
batch share one `argmax` in `sample_rows` (argmax is exact, so the batch shape
cannot move it).

Logits on a GPU. A row's `int(argmax(row))`, or any of the list work above,
waits for the device: once per row, so a step of 64 decodes waited 64 times.
`StepLogits` takes a step's rows once: the plain greedy rows' tokens from one
argmax and one copy, every other row copied to the host together; the engine
then takes a decided token or samples the host row (`sample_row`). On the CPU it hands the
rows on as they are.
"""

from __future__ import annotations

import bisect
import math
import random
import secrets
from itertools import accumulate
from operator import neg

import torch

from pagoda.core.outputs import SampledToken
from pagoda.core.request import Request


class StepLogits:
    """One step's logits rows [R, V] as sampling reads them, taken from a GPU with one wait (the design note).

    `greedy[i]` is row i's token where its request is plain greedy and the rows are on a GPU (None elsewhere);
    `row(i)` is row i on the host. A row whose request is None is read whole (a prompt row: `score_row`)."""

    def __init__(self, logits: torch.Tensor, requests: list[Request | None]) -> None:
        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        self.greedy: list[int | None] = [None] * len(requests)
        self._rows, self._index = logits, None  # CPU: every row as it is
        if logits.device.type == "cpu" or not requests:
            return
        plain, others = [], []
        for i, request in enumerate(requests):
            (plain if request is not None and _plain_greedy(request) else others).append(i)
        if plain:  # one argmax and one copy for every plain greedy row [len(plain)]
            ids = (logits if not others else logits[plain]).argmax(dim=-1)
            for i, token_id in zip(plain, ids.tolist()):
                self.greedy[i] = token_id
        if others:  # the rows sampled on the host, copied together [len(others), V]
            self._rows = (logits if not plain else logits[others]).cpu()
            self._index = {i: j for j, i in enumerate(others)}

    def row(self, i: int) -> torch.Tensor:
        """Row i [V] on the host (a plain greedy GPU row is not copied: read `greedy[i]`)."""
        return self._rows[i if self._index is None else self._index[i]]


class Sampler:
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Pick one token per row; logits [len(requests), vocab] float32. Raises the first row's failure."""
        tokens = self.sample_rows(logits, requests)
        for token in tokens:
            if isinstance(token, Exception):
                raise token
        return tokens

    def sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken | Exception]:
        """One token per row of logits [len(requests), vocab]; a row that fails holds its exception instead."""
        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        tokens: list[SampledToken | Exception | None] = [None] * len(requests)
        plain = [i for i, request in enumerate(requests) if _plain_greedy(request)]
        if plain:  # one argmax over the plain greedy rows [len(plain), vocab]
            rows = logits if len(plain) == len(requests) else logits[plain]
            for i, token_id in zip(plain, rows.argmax(dim=-1).tolist()):
                tokens[i] = SampledToken(token_id)
        for i, request in enumerate(requests):
            if tokens[i] is None:
                try:
                    tokens[i] = self.sample_row(logits[i], request)
                except Exception as exc:  # that request's alone
                    tokens[i] = exc
        return tokens

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
            token_id = _draw(row, params, _stream(request).random())
        if request.grammar is not None:
            request.grammar.accept(token_id)
        if logprobs is None:
            return SampledToken(token_id)
        return SampledToken(token_id, float(logprobs[token_id]), _top(logprobs, params.logprobs))


def score_row(row: torch.Tensor, token_id: int, k: int) -> SampledToken:
    """How the model's own distribution at one position [vocab] scores the token that came next: its logprob, its
    rank (1 = the most likely) and the k most likely tokens. Reads the row alone, as sampling does."""
    logprobs = torch.log_softmax(row, dim=-1)
    logprob = logprobs[token_id]
    rank = int((logprobs > logprob).sum()) + 1
    return SampledToken(token_id, float(logprob), _top(logprobs, k), rank=rank)


def _top(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely (token id, logprob) pairs of a row, most likely first."""
    if not k:
        return ()
    values, ids = torch.topk(logprobs, k)
    return tuple(zip(ids.tolist(), values.tolist()))


def _plain_greedy(request: Request) -> bool:
    """Greedy with nothing that reshapes its row first (grammar, penalties) or reads it after (logprobs)."""
    params = request.sampling_params
    return params.greedy and request.grammar is None and not params.has_penalties and params.logprobs is None


def _stream(request: Request) -> random.Random:
    if request.generator is None:
        seed = request.sampling_params.seed
        # any 64-bit seed, signed or not: a negative one folds to seed mod 2**64 (as torch.Generator does)
        request.generator = random.Random(secrets.randbits(63) if seed is None else seed % 2**64)
    return request.generator


_FIRST_CANDIDATES = 64  # the top-p / min-p path first looks at this many tokens, then 8x more, up to the vocabulary
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _draw(row: torch.Tensor, params, u: float) -> int:
    """Temperature, top-k, top-p and min-p, then the token at u (uniform in [0, 1)) of what is left's CDF."""
    vocab = row.shape[0]
    if 0 < params.top_k < vocab:
        return _draw_top_k(row, params, u)
    if params.top_p < 1.0 or params.min_p > 0:
        return _draw_nucleus(row, params, u)
    # nothing filters: the draw runs on the whole row's CDF [vocab], on the tensor
    cum = torch.softmax(_scaled(row, params), dim=-1).cumsum(dim=-1)
    total = float(cum[-1])
    _check_total(total)
    i = int(torch.searchsorted(cum, u * total, right=True))  # the first token whose CDF passes u * total
    return i if i < vocab else int(torch.searchsorted(cum, total))


def _scaled(row: torch.Tensor, params) -> torch.Tensor:
    row = row / params.temperature
    if params.has_penalties:  # a logit a penalty pushed past float range is the largest finite one
        row = torch.nan_to_num(row, nan=float("-inf"), posinf=_FLOAT32_MAX)
    return row


def _draw_top_k(row: torch.Tensor, params, u: float) -> int:
    """Top-k's candidates [k] come to Python: their weights, then top-p, min-p and the draw on a short list."""
    k = params.top_k
    values, ids = torch.topk(row, k + 1)  # one more, to see a tie at the k-th
    logits = values.tolist()
    if logits[k] == logits[k - 1] != float("-inf"):  # tokens tied with the k-th all stay (as a `< kth` mask keeps)
        values, ids = torch.topk(row, int((row >= logits[k - 1]).sum()))
        logits = values.tolist()
    else:
        del logits[k]
    if params.has_penalties:
        logits = [min(x, _FLOAT32_MAX) for x in logits]
    top = logits[0] / params.temperature
    weights = [math.exp(x / params.temperature - top) for x in logits]  # descending, the first 1.0
    return ids.tolist()[_pick(weights, math.fsum(weights), params, u, complete=True)]


def _draw_nucleus(row: torch.Tensor, params, u: float) -> int:
    """Top-p / min-p over the whole vocabulary: the most likely tokens, more of them until the kept ones all are."""
    probs = torch.softmax(_scaled(row, params), dim=-1)  # [vocab]
    vocab, size = probs.shape[0], min(probs.shape[0], _FIRST_CANDIDATES)
    while True:  # at most log8(vocab / 64) + 1 rounds: the last looks at the whole vocabulary
        values, ids = torch.topk(probs, size)
        picked = _pick(values.tolist(), 1.0, params, u, complete=size == vocab)
        if picked is not None:
            return int(ids[picked])
        size = min(vocab, size * 8)


def _pick(weights: list[float], total: float, params, u: float, complete: bool) -> int | None:
    """The index u lands on in `weights` (sorted descending; `total` the whole distribution's) after top-p and
    min-p; None when tokens past the list might be kept too (only when the list is not `complete`)."""
    cum = list(accumulate(weights))
    n = len(weights)
    decided = complete
    if params.top_p < 1.0:
        # keep a token while the tokens before it stay below top_p: the one that crosses it stays, and so
        # does the most likely token (a top_p below float32's range keeps only that)
        n = 1 + bisect.bisect_left(cum, params.top_p * total, 0, n - 1)
        decided = decided or cum[-1] >= params.top_p * total
    if params.min_p > 0:
        floor = params.min_p * weights[0]
        n = min(n, bisect.bisect_right(weights, -floor, key=neg))  # the leading weights >= floor
        decided = decided or weights[-1] < floor
    if not decided:
        return None
    total = cum[n - 1]
    _check_total(total)
    i = bisect.bisect_right(cum, u * total, 0, n)  # the first candidate whose CDF passes u * total
    return i if i < n else bisect.bisect_left(cum, total, 0, n)


def _check_total(total: float) -> None:
    # u * total rounding up to total finds no CDF entry past it: the callers then take the last candidate
    # that carries probability (the first whose CDF reaches total)
    if not total > 0:  # nan or 0: nothing left to sample from
        raise ValueError("no token has a finite logit to sample from (a NaN row, or every token masked)")


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
