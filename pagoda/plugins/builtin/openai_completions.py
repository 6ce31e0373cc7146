"""OpenAI's legacy text completions: POST /v1/completions (a plain prompt, no chat template)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagoda.core.outputs import RequestOutput
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Call, Completion, Endpoint, Event
from pagoda.plugins.protocol import Generation, RequestError, ServeContext, make_sampling_params


class CompletionRequest(oc.SamplingFields, kw_only=True):
    # str, [str], [int] or [[int]]: msgspec cannot tell list types apart in a union, so `prompt_ids` checks it.
    prompt: str | list[Any]
    max_tokens: oc.PositiveInt | None = None
    logprobs: oc.TopLogprobs | None = None
    echo: bool = False
    best_of: oc.PositiveInt | None = None
    suffix: str | None = None
    # Structured output (extensions, as vLLM names them; at most one): docs/protocols/openai-completions.md
    response_format: ot.ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def prompt_ids(prompt: str | list[Any], ctx: ServeContext) -> list[list[int]]:
    """Each prompt's token ids, in order: a string, a list of token ids, or a list of those (text is encoded)."""
    if isinstance(prompt, str):
        return [ctx.encode(prompt)]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, list) and not (p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
                raise RequestError(f"prompt[{i}] must be a string or a non-empty list of token ids", "prompt")
            out.append(ctx.encode(p) if isinstance(p, str) else list(p))
        return out
    raise RequestError("prompt must be a string, a list of token ids, or a list of those", "prompt")


class Completions(oc.Choices, Endpoint):
    name = "openai-completions"
    protocol = "completions"
    path = "/v1/completions"
    body_type = CompletionRequest
    id_prefix = "cmpl-"
    errors = oc.OPENAI_ERRORS

    def prepare(self, body: CompletionRequest, ctx: ServeContext) -> list[Generation]:
        if body.best_of not in (None, 1):
            raise RequestError("best_of must be 1", "best_of")
        if body.suffix:
            raise RequestError("suffix (insertion) is not supported", "suffix")
        if body.echo and body.logprobs is not None:
            raise RequestError("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        constraint = ot.guided(body)
        generations = []
        for ids in prompt_ids(body.prompt, ctx):  # one engine request per prompt (and per choice: choices.fan_out)
            params = make_sampling_params(
                limits=ctx.limits,
                max_tokens=body.max_tokens or ctx.default_max_tokens(len(ids)),
                logprobs=body.logprobs,
                constraint=constraint,
                **body.sampling_fields(),
            )
            generations.append(Generation(ids, params, stream=body.stream, cache_salt=body.cache_salt, n=body.n))
        return generations

    def _echo(self, call: Call) -> str:
        if not call.body.echo:
            return ""
        prompt = call.body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[call.index // call.body.n]  # this choice's prompt (index = prompt_i * n + j)
        return prompt if isinstance(prompt, str) else call.tokenizer.decode(call.generation.prompt_token_ids)

    def _logprobs(self, call: Call, tokens, offset: int) -> dict[str, Any] | None:
        if call.body.logprobs is None:
            return None
        return oc.completion_logprobs(call, tokens, offset)

    def _chunk(self, call: Call, text: str, finish_reason: str | None, logprobs: Any) -> dict[str, Any]:
        return {
            "id": call.id,
            "object": "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [{"index": call.index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        }

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        echo = self._echo(call)
        body = self._chunk(call, echo + completion.text, oc.finish_reason(completion.finish_reason),
                           self._logprobs(call, completion.logprobs, len(echo)))
        body["usage"] = oc.usage(completion.num_prompt_tokens, completion.num_output_tokens,
                                 completion.num_cached_tokens)
        return body

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        offset = 0
        echo = self._echo(call)
        if echo:
            yield Event(self._chunk(call, echo, None, None))
            offset = len(echo)
        last = None
        async for out in outputs:
            last = out
            reason = oc.finish_reason(out.finish_reason) if out.finished else None
            if out.new_text or out.logprobs or reason:
                yield Event(self._chunk(call, out.new_text, reason, self._logprobs(call, out.logprobs, offset)))
                offset += len(out.new_text)
        if call.body.include_usage and last is not None:
            yield Event(oc.usage_chunk(self._chunk(call, "", None, None), last))
        yield Event("[DONE]")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        body = {**oc.client_fields(ask), "prompt": ask.flat_prompt}
        if ask.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> CompletionAnswer:
        return CompletionAnswer()


class CompletionAnswer(oc.ChoicesAnswer):
    """A client's view of a completion: each choice's `text`."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        return choice.get("text") or ""


@hookimpl
def pagoda_register_protocols(register):
    register(Completions())
