"""Per-request sampling parameters, validated once where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.constraint import Constraint


# torch.Generator takes any 64-bit seed, signed or not (a negative one folds to seed mod 2**64);
# OpenAI's and vLLM's seeds are 64-bit integers, so that is the range a request may name.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_LOGPROBS = 20  # top alternatives a token's logprobs may list (a server may allow fewer: RequestLimits)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as vLLM's sampler treats them)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its next tokens and when it stops.

    temperature == 0 means greedy. A sampled request without a `seed` gets a
    fresh random seed from the sampler, so its stream is still private to it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = off; k >= 0 = the chosen token's logprob plus the top k
    # None = off; k >= 0 = each prompt token's logprob (the first has none) plus the top k at its position.
    # With max_tokens 0 the prompt is only scored: nothing is generated.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: Constraint | None = None  # what the output must match (a JSON schema, a grammar, ...)

    def __post_init__(self) -> None:
        # Normalise list-like inputs so a params object is hashable-ish and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool), "max_tokens", "must be an integer")
        _check(self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
               f"must be at least 1 (0 only scores a prompt, with prompt logprobs), got {self.max_tokens}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and SEED_MIN <= self.seed <= SEED_MAX),
               "seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    @property
    def greedy(self) -> bool:
        # A temperature this small is argmax anyway, and dividing by it (5e-324) overflows the logits.
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")
