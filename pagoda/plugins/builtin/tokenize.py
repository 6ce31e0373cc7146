"""Token routes: POST /tokenize and POST /detokenize (vLLM's shapes), in OpenAI's error shape.

    /tokenize      {"model"?, "prompt", "add_special_tokens"?: true}
                   or {"model"?, "messages", "add_generation_prompt"?: true}
                   -> {"tokens": [...], "count", "max_model_len"}
    /detokenize    {"model"?, "tokens": [...]} -> {"prompt"}

(Anthropic's POST /v1/messages/count_tokens belongs to its messages endpoint: anthropic_messages.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request
from litestar.params import JSONBody

from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import ServeContext
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import Route, RouteContext


class ChatTurn(msgspec.Struct):
    role: str
    content: str


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatTurn] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


def _serving(ctx: RouteContext) -> ServeContext:
    if ctx.serving is None:
        raise RuntimeError("the token routes need a served model's tokenizer")
    return ctx.serving


def make_tokenize(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of POST /tokenize."""
    serving = _serving(ctx)

    async def tokenize(data: JSONBody[TokenizeRequest], request: Request) -> dict[str, Any]:
        """The token ids of a prompt, or of a conversation rendered with the chat template."""
        ctx.resolve_model(request, data.model)  # 404 for a model not served; an adapter tokenizes as its base
        if (data.prompt is None) == (data.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if data.prompt is not None:
            tokens = serving.tokenizer.encode(data.prompt, add_special_tokens=data.add_special_tokens is not False)
        else:
            if not serving.tokenizer.has_chat_template:
                raise RequestError("this model has no chat template", "messages")
            text = serving.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in data.messages],
                                                         add_generation_prompt=data.add_generation_prompt)
            tokens = serving.tokenizer.encode(text, add_special_tokens=data.add_special_tokens is True)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    return tokenize


def make_detokenize(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of POST /detokenize."""
    serving = _serving(ctx)

    async def detokenize(data: JSONBody[DetokenizeRequest], request: Request) -> dict[str, Any]:
        """The text of token ids."""
        ctx.resolve_model(request, data.model)
        vocab = serving.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(data.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"tokens[{bad}]: {data.tokens[bad]} is outside the vocabulary (0..{vocab - 1})",
                               f"tokens[{bad}]")
        return {"prompt": serving.tokenizer.decode(data.tokens, skip_special_tokens=False)}

    return detokenize


@hookimpl
def pagoda_register_routes(register):
    register(Route("POST", "/tokenize", make_tokenize, errors=OPENAI_ERRORS))
    register(Route("POST", "/detokenize", make_detokenize, errors=OPENAI_ERRORS))
