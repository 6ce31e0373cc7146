"""Prompt-lookup (n-gram) speculative decoding: drafts from the request's own tokens, verified greedily.

Design note. The CPU matmuls pad a step's rows to a multiple of 4 for batch
invariance (`model/matmul.py`), so a lone decode computes three rows that are
thrown away. The scheduler fills such rows with drafts: the tokens that
followed the latest n-gram's earliest earlier occurrence (vLLM's "ngram"
method). A speculated chunk computes the request's last token plus its
drafts; the runner returns a logits row for each. The engine samples row j as
the plain decode would (its logits are the same bits: every row is computed on
its own, whether in a decode or a prefill chunk) and keeps draft j only if it
equals that token, so the text is the plain decode's token for token; the
token after the last kept draft comes free. Rejected drafts' KV slots are
overwritten when those positions are computed for real, and their blocks
return at once (`BlockManager.trim`): no new ledger state.

What runs is a setting, never a kernel's accident: `EngineConfig.speculative`
says whether drafts run and how many rows beyond the padding a step may give
them (`max_extra_rows`, 0 by default); the runner declares its row multiple;
`in_force` combines the two into the `Speculation` the engine reports at
start-up and in /health, with the reason when it is off (a runner that pads
nothing, int8/int4 weights or CUDA, leaves no row to fill unless extra rows
are allowed).

Only greedy, unconstrained requests speculate: a sampled one would need
rejection sampling, which would move its seeded random stream. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.core.engine_config import SpeculativeConfig
from pagoda.core.request import Request

if TYPE_CHECKING:
    from pagoda.core.batch import ScheduledChunk
    from pagoda.core.outputs import SampledToken


@dataclass(frozen=True)
class Speculation:
    """The speculation in force: the config drafts run with (None: none run), and why, in words."""

    config: SpeculativeConfig | None
    reason: str

    @property
    def active(self) -> bool:
        return self.config is not None

    def describe(self) -> dict[str, object]:
        """For /health: whether drafts run, why, and the settings they run with."""
        settings = {} if self.config is None else {
            "method": self.config.method, "num_speculative_tokens": self.config.num_speculative_tokens,
            "max_extra_rows": self.config.max_extra_rows}
        return {"active": self.active, "reason": self.reason, **settings}


def in_force(config: SpeculativeConfig | None, row_multiple: int) -> Speculation:
    """What the setting and the runner's row multiple leave running."""
    if config is None:
        return Speculation(None, "off: --speculative-config is empty")
    if row_multiple <= 1 and config.max_extra_rows == 0:
        return Speculation(None, "off: the runner pads no rows (its matmuls need none: the int8/int4 formats, CUDA,"
                                 " or torch's plain products on a CPU without native bfloat16) and"
                                 " speculative_config.max_extra_rows is 0, so no step has a row to give a draft")
    rows = f"the rows the runner pads (to a multiple of {row_multiple})" if row_multiple > 1 else ""
    extra = f"up to {config.max_extra_rows} more rows a step" if config.max_extra_rows else ""
    where = " and ".join(part for part in (rows, extra) if part)
    return Speculation(config, f"on: {config.method}, up to {config.num_speculative_tokens} drafts per greedy request,"
                               f" in {where}")


def propose(token_ids: Sequence[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram, or [].

    n runs from `lookup_max` down to `lookup_min`; the occurrence may overlap the suffix but is not the
    suffix itself. Bounded: at most (lookup_max - lookup_min + 1) scans of the list, each `list.index`
    hops (C speed) plus an n-token comparison per candidate, so O(lookup_max^2 * len(token_ids)).
    """
    total = len(token_ids)
    if k < 1 or total < 2:
        return []
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = tokens[total - n :]
        first, stop = suffix[0], total - n  # a match starts before the suffix does
        i = -1
        while True:
            try:
                i = tokens.index(first, i + 1, stop)
            except ValueError:
                break
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def can_speculate(request: Request) -> bool:
    """Greedy and unconstrained: its verified tokens are then exactly the plain decode's."""
    params = request.sampling_params
    return params.greedy and params.constraint is None and request.grammar is None


def drafts_for(request: Request, spec: SpeculativeConfig, limit: int, max_model_len: int) -> list[int]:
    """The request's drafts this step: at most `limit`, and never past max_tokens or the context."""
    # a step emits at most drafts + 1 tokens; the last of them is never computed
    room = min(request.sampling_params.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
    k = min(limit, spec.num_speculative_tokens, room)
    if k < 1 or not can_speculate(request):
        return []
    return propose(request.all_token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min)


def padding_waste(num_rows: int, row_multiple: int) -> int:
    """Rows the runner pads `num_rows` with to reach its row multiple."""
    return -num_rows % row_multiple


def num_spare_rows(num_rows: int, row_multiple: int, extra_rows: int) -> int:
    """Rows a step of `num_rows` may give drafts: its padding to the row multiple, plus `extra_rows`."""
    return padding_waste(num_rows, row_multiple) + extra_rows


@dataclass
class SpecCounters:
    """Drafts proposed and kept, over the engine's life (vLLM's names; `/metrics` shows them)."""

    draft_tokens_total: int = 0
    accepted_tokens_total: int = 0

    def count(self, chunk: ScheduledChunk, tokens: Sequence[SampledToken]) -> bool:
        """Count a verified chunk's drafts and the leading run of them its tokens kept; False if it had none."""
        if not chunk.draft_token_ids:
            return False
        self.draft_tokens_total += len(chunk.draft_token_ids)
        for draft, token in zip(chunk.draft_token_ids, tokens):
            if draft != token.token_id:
                break
            self.accepted_tokens_total += 1
        return True

    def stats(self) -> dict[str, int]:
        """The engine stats' entries."""
        return {"spec_decode_draft_tokens_total": self.draft_tokens_total,
                "spec_decode_accepted_tokens_total": self.accepted_tokens_total}
