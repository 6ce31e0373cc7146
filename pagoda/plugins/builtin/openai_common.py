"""What the three OpenAI endpoints share: sampling fields, errors, usage, logprobs, finish reasons."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from pagoda.core.request import FinishReason
from pagoda.core.outputs import SampledToken
from pagoda.core.sampling_params import SamplingParams
from pagoda.plugins.protocol import ApiError, Call, RequestError

# Value ranges are declared on the fields, so a bad value is refused while decoding, naming the field.
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields of completions and chat, with the extensions OpenAI's schema lacks."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    user: str | None = None
    # Extensions (as vLLM accepts them):
    top_k: TopK = 0  # 0 or -1 = off
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False


def check_n(n: int) -> None:
    """One sequence per request: n > 1 is refused rather than half-supported."""
    if n != 1:
        raise RequestError("n must be 1: pagoda returns one choice per request; send n requests instead", "n")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 16:
        raise RequestError("stop may hold at most 16 sequences", "stop")
    if not all(stops):
        raise RequestError("stop sequences must be non-empty strings", "stop")
    return stops


def logit_bias(raw: Mapping[str, float] | None) -> dict[int, float]:
    if not raw:
        return {}
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids", "logit_bias") from None


def sampling_fields(body: SamplingFields) -> dict[str, Any]:
    """The SamplingParams keywords common to completions and chat."""
    check_n(body.n)
    return dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=body.seed,
        stop=stop_strings(body.stop),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        ignore_eos=body.ignore_eos,
        logit_bias=logit_bias(body.logit_bias),
    )


def finish_reason(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                404: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error"}
_ERROR_CODES = {401: "invalid_api_key", 404: "not_found"}


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = _ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": error.code or _ERROR_CODES.get(error.status),
        }
    }


def token_logprob(call: Call, token_id: int, logprob: float) -> dict[str, Any]:
    text = call.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(call: Call, tokens: Sequence[SampledToken]) -> list[dict[str, Any]]:
    """Chat/responses shape: one entry per token, each with its top alternatives."""
    entries = []
    for t in tokens:
        entry = token_logprob(call, t.token_id, _finite(t.logprob))
        entry["top_logprobs"] = [token_logprob(call, i, _finite(lp)) for i, lp in (t.top_logprobs or ())]
        entries.append(entry)
    return entries


def completion_logprobs(call: Call, tokens: Sequence[SampledToken], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions shape: parallel lists of tokens, logprobs, top alternatives and offsets."""
    texts = [call.token_text(t.token_id) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{call.token_text(i): _finite(lp) for i, lp in (t.top_logprobs or ())} for t in tokens],
        "text_offset": offsets,
    }


def _finite(value: float | None) -> float:
    # JSON has no -inf; a token the filters made impossible still needs a number.
    if value is None or value != value:
        return -9999.0
    return max(value, -9999.0)
