"""The state of one request as it moves through the scheduler's queues.

A request is its tokens (prompt + output so far) and how many of them have
their KV in the cache (`num_computed_tokens`). There is no prefill or decode
state: each step computes some of the tokens not yet computed, and when the
computed tokens reach the end a new token is sampled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagoda.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Names match the scheduler queue that holds the request."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the caller asked (e.g. the client went away)
    ERROR = "error"  # the model step failed


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # Engine-clock (time.monotonic) stamps for the queue/prefill/decode split; None until it happens.
    scheduled_time: float | None = None  # the start of the first step that computed any of its tokens
    first_token_time: float | None = None  # the end of the step that sampled its first token
    finished_time: float | None = None  # when it left the scheduler, for whatever reason
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    # Prefix caching: the extra keys a block hash covers (requests share blocks only when both are
    # equal), the chain of full-block hashes (kept across preemption: tokens never change), and the
    # prompt tokens found in the cache when the request was first scheduled (usage's cached_tokens).
    cache_salt: str | None = None
    tenant: str | None = None  # who the request is for: the fair policy's unit (None is one tenant)
    # the LoRA adapter its rows add (a loaded adapter's name; None: the base model alone), and the key its KV is
    # cached under, part of its block hashes: the name, or name#n for a name loaded again (core/adapters.py); left
    # None it is the name
    adapter: str | None = None
    adapter_key: str | None = None
    priority: int = 0  # the priority policy's order: lower runs first (vLLM's meaning)
    weight: float = 1.0  # the tenant's weight under the fair policy: its share of slots and tokens
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Opaque per-request sampling state (a torch.Generator), owned by the sampler.
    # Kept on the request so that it survives preemption untouched.
    generator: Any = None
    # Opaque per-request text state (incremental detokenizer), owned by the engine.
    text_stream: Any = None
    # Opaque per-request grammar matcher (core/grammar.py) for a constrained request, set at admission.
    # Its state is the output tokens accepted so far, which preemption keeps: it needs no rollback.
    grammar: Any = None
    # Prompt logprobs (sampling_params.prompt_logprobs): position i's entry scores prompt token i (the first has no
    # logprob), filled in as the prefill's chunks compute them and reported with the first output.
    prompt_logprobs: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.adapter_key is None:
            self.adapter_key = self.adapter

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """True while the request's prompt logprobs are still to come: asked for, and nothing sampled yet."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def max_kv_tokens(self) -> int:
        """KV slots the request can ever hold: its last sampled token is never computed (max_tokens 0: the prompt)."""
        return self.num_prompt_tokens + max(self.sampling_params.max_tokens, 1) - 1
