"""OpenAI's legacy text completions: POST /v1/completions (a plain prompt, no chat template)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagoda.core.outputs import AnswerDelta, SampledToken
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Answer, Endpoint, EngineRequest, Event, Exchange, ServeContext
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import ServedModel
from pagoda.plugins.turn import Turn, engine_request


class CompletionRequest(oc.SamplingFields, kw_only=True):
    # str, [str], [int] or [[int]]: msgspec cannot tell list types apart in a union, so `prompts` checks it.
    prompt: str | list[Any]
    max_tokens: oc.NonNegativeInt | None = None  # 0: score the prompt only (echo with logprobs, or prompt_logprobs)
    logprobs: oc.TopLogprobs | None = None
    echo: bool = False  # with logprobs: the prompt's tokens and logprobs too, before the answer's
    prompt_logprobs: oc.TopLogprobs | None = None  # vLLM's extension: each choice's `prompt_logprobs`
    best_of: oc.PositiveInt | None = None
    suffix: str | None = None
    # Structured output (extensions, as vLLM names them; at most one): docs/protocols/openai-completions.md
    response_format: ot.ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """Each prompt, in order, as text or token ids: a string, a list of strings, a list of token ids, or a list of
    those lists.

    A list is one of these all through: text and token ids mixed (`[[1, 2], "x"]`, `[1, "x"]`) are refused, as
    OpenAI refuses them."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not (p and all(_is_token_id(t) for t in p)):
                raise RequestError(f"prompt[{i}] must be a non-empty list of token ids", "prompt")
        return [list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists,"
                       " not a mix of them", "prompt")


def completion_turns(body: CompletionRequest) -> list[Turn]:
    """The body as turns, one per prompt (and per choice: choices.fan_out), sharing the constraint and sampling."""
    if body.best_of not in (None, 1):
        raise RequestError("best_of must be 1", "best_of")
    if body.suffix:
        raise RequestError("suffix (insertion) is not supported", "suffix")
    constraint = ot.guided(body)
    sampling = dict(body.sampling_fields(), logprobs=body.logprobs, prompt_logprobs=_prompt_logprobs(body))
    return [Turn(prompt=prompt, constraint=constraint, max_tokens=body.max_tokens, sampling=sampling, n=body.n,
                 stream=body.stream, cache_salt=body.cache_salt, priority=body.priority)
            for prompt in prompts(body.prompt)]


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives the engine lists at each prompt position: echo's with logprobs, vLLM's field, or both."""
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Completions(oc.Choices, Endpoint):
    name = "openai-completions"
    protocol = "completions"
    path = "/v1/completions"
    body_type = CompletionRequest
    id_prefix = "cmpl-"
    errors = OPENAI_ERRORS

    def prepare(self, body: CompletionRequest, ctx: ServeContext) -> list[EngineRequest]:
        requests = []
        for turn in completion_turns(body):
            requests.append(engine_request(turn, ctx))
        return requests

    def _echo(self, exchange: Exchange) -> str:
        if not exchange.body.echo:
            return ""
        prompt = exchange.body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[exchange.index // exchange.body.n]  # this choice's prompt (index = prompt_i * n + j)
        return prompt if isinstance(prompt, str) else exchange.tokenizer.decode(exchange.request.prompt_token_ids)

    def _logprobs(self, exchange: Exchange, tokens, offset: int) -> dict[str, Any] | None:
        if exchange.body.logprobs is None:
            return None
        return oc.completion_logprobs(exchange, tokens, offset)

    def _chunk(self, exchange: Exchange, text: str, finish_reason: str | None, logprobs: Any,
               prompt_logprobs: Sequence[SampledToken] | None = None) -> dict[str, Any]:
        choice = {"index": exchange.index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if prompt_logprobs is not None and exchange.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = oc.prompt_logprobs(exchange, prompt_logprobs)
        return {
            "id": exchange.id,
            "object": "text_completion",
            "created": exchange.created,
            "model": exchange.model,
            "choices": [choice],
        }

    def _echoed(self, exchange: Exchange, echo: str, prompt_logprobs: Sequence[SampledToken] | None) -> Any:
        """The echoed prompt's logprobs (legacy shape): asked with echo and logprobs, they come with the answer."""
        return self._logprobs(exchange, prompt_logprobs or [], 0) if echo else None

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        echo = self._echo(exchange)
        logprobs = self._logprobs(exchange, answer.logprobs, len(echo))
        if logprobs is not None and echo:
            logprobs = oc.joined_logprobs([self._echoed(exchange, echo, answer.prompt_logprobs), logprobs])
        body = self._chunk(exchange, echo + answer.text, oc.finish_reason(answer.finish_reason), logprobs,
                           answer.prompt_logprobs)
        body["usage"] = oc.usage(answer.num_prompt_tokens, answer.num_output_tokens,
                                 answer.num_cached_tokens)
        return body

    async def render_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        echo = self._echo(exchange)
        # the echoed prompt goes first: at once, or with the first output when its logprobs were asked
        pending = echo if echo and exchange.body.logprobs is not None else ""
        if echo and not pending:
            yield Event(self._chunk(exchange, echo, None, None))
        offset = len(echo)
        last = None
        async for out in deltas:
            last = out
            reason = oc.finish_reason(out.finish_reason) if out.finished else None
            if pending or out.prompt_logprobs is not None:
                yield Event(self._chunk(exchange, pending, None, self._echoed(exchange, pending, out.prompt_logprobs),
                                        out.prompt_logprobs))
                pending = ""
            if out.new_text or out.logprobs or reason:
                yield Event(self._chunk(exchange, out.new_text, reason, self._logprobs(exchange, out.logprobs, offset)))
                offset += len(out.new_text)
        if exchange.body.include_usage and last is not None:
            yield Event(oc.usage_chunk(self._chunk(exchange, "", None, None), last))
        yield Event("[DONE]")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        body = {**oc.client_fields(ask), "prompt": ask.flat_prompt}
        if ask.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> CompletionAnswer:
        return CompletionAnswer()


class CompletionAnswer(oc.ChoicesAnswer):
    """A client's view of a answer: each choice's `text`."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        return choice.get("text") or ""


@hookimpl
def pagoda_register_protocols(register):
    register(Completions())


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """OpenAI's fields of the model card (client.models.list and retrieve read them)."""
    return oc.model_card(model)
