"""What the engine reports: a sampled token, and what one step produced for one request (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.request import FinishReason


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token under the model's distribution
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # the k most likely tokens


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[SampledToken] = field(default_factory=list)  # for new_token_ids, when asked
    error: str | None = None
