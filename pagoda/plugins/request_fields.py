"""What a request's fields may say: the protocols' refusal, their shared field helpers and the request limits.

Part of the plugin interface (`pagoda.plugins.protocol` re-exports every name here): a protocol's
`prepare` raises `RequestError` naming the field it refuses, builds its SamplingParams with
`make_sampling_params` (checked against the server's `RequestLimits`) and joins text parts with
`join_text_parts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.core.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the protocol refuses: answered with `status` (400) and the protocol's error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def join_text_parts(content: Any, field: str, text_types: Sequence[str] = ("text",), index: str = "[{}]") -> str:
    """A message's text: a string, or a list of parts (`.type`, `.text`) that must all be text; names a bad part."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        where = field + index.format(j)
        if part.type not in text_types or part.text is None:
            raise RequestError(f"{where}: only text content is supported, got type {part.type!r}", where)
        texts.append(part.text)
    return "\n".join(texts)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, beyond the value ranges of its fields (the serve options set them)."""

    max_stop: int = 16  # stop strings in one request
    max_stop_length: int = 1_000  # characters in one stop string
    max_logprobs: int = 20  # top alternatives per token (the most SamplingParams allows)
    max_tokens: int | None = None  # output tokens of one request; None = whatever fits the context

    def __post_init__(self) -> None:
        for name in ("max_stop", "max_stop_length", "max_logprobs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError, starting with SamplingParams' field name, for params over a limit."""
        if len(params.stop) > self.max_stop:
            raise ValueError(f"stop may hold at most {self.max_stop} strings, got {len(params.stop)}")
        if any(len(s) > self.max_stop_length for s in params.stop):
            raise ValueError(f"stop strings may be at most {self.max_stop_length} characters long")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} may be at most {self.max_logprobs}, got {k}")
        if self.max_tokens is not None and params.max_tokens > self.max_tokens:
            raise ValueError(f"max_tokens may be at most {self.max_tokens}, got {params.max_tokens}")


DEFAULT_LIMITS = RequestLimits()


def make_sampling_params(renames: Mapping[str, str] | None = None, *, limits: RequestLimits | None = None,
                         **fields: Any) -> SamplingParams:
    """SamplingParams(**fields), a None field taking its default, checked against `limits`; a ValueError becomes a
    RequestError naming the protocol's field (`renames`: SamplingParams' name -> the protocol's)."""
    try:
        params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        (limits or DEFAULT_LIMITS).check(params)
        return params
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        name, _, why = str(exc).partition(" ")
        param = (renames or {}).get(name, name)
        raise RequestError(f"{param} {why}", param) from None
