"""What the engine reports: a sampled token, and what one step produced for one request (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.core.request import FinishReason, Request


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token under the model's distribution
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # the k most likely tokens
    rank: int | None = None  # a prompt token's place in its position's distribution (1 = the most likely)


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's engine-clock stamps (seconds, time.monotonic); None where it never got there."""

    arrival: float
    scheduled: float | None  # its first step began
    first_token: float | None  # the step that sampled its first token ended
    finished: float  # it left the scheduler

    @property
    def queue_seconds(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def prefill_seconds(self) -> float | None:
        """First scheduled to first token (a preemption before the first token counts here)."""
        return None if self.scheduled is None or self.first_token is None else self.first_token - self.scheduled

    @property
    def decode_seconds(self) -> float | None:
        return None if self.first_token is None else self.finished - self.first_token


@dataclass
class AnswerDelta:
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
    # with the first output of a request that asked for prompt logprobs: one entry per prompt token, the first
    # with no logprob (nothing comes before it)
    prompt_logprobs: list[SampledToken] | None = None
    error: str | None = None
    error_field: str | None = None  # the request field the error is that field's to fix (the server answers 4xx)
    times: RequestTimes | None = None  # on a request's last output only

    @classmethod
    def of(cls, request: Request, token_ids: list[int], text: str, **extra: Any) -> AnswerDelta:
        """The output of a request's step: its new tokens and text, its counts, and its times once finished."""
        return cls(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            stop_reason=request.stop_reason,
            times=RequestTimes(request.arrival_time, request.scheduled_time, request.first_token_time,
                               request.finished_time) if request.is_finished else None,
            num_cached_tokens=request.num_cached_tokens,
            **extra,
        )
