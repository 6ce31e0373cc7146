"""OpenAI chat completions: POST /v1/chat/completions (messages through the model's chat template)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Call, Completion, Endpoint, Event
from pagoda.plugins.protocol import Generation, RequestError, ServeContext, join_text_parts, make_sampling_params


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(oc.SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: oc.PositiveInt | None = None
    max_completion_tokens: oc.PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: oc.TopLogprobs | None = None


def template_messages(messages: list[ChatMessage], field: str = "messages") -> list[dict[str, str]]:
    """Messages as the chat template reads them: a role and plain-text content."""
    if not messages:
        raise RequestError(f"{field} must hold at least one message", field)
    return [oc.template_message(m.role, join_text_parts(m.content, f"{field}[{i}].content"))
            for i, m in enumerate(messages)]


class ChatCompletions(Endpoint):
    name = "openai-chat"
    protocol = "chat"
    path = "/v1/chat/completions"
    body_type = ChatRequest
    id_prefix = "chatcmpl-"
    errors = oc.OPENAI_ERRORS

    def prepare(self, body: ChatRequest, ctx: ServeContext) -> Generation:
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        ids = ctx.encode_chat(template_messages(body.messages))
        max_tokens = body.max_completion_tokens or body.max_tokens or ctx.default_max_tokens(len(ids))
        params = make_sampling_params(
            max_tokens=max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            **body.sampling_fields(),
        )
        return Generation(ids, params, stream=body.stream)

    def _logprobs(self, call: Call, tokens) -> dict[str, Any] | None:
        return {"content": oc.chat_logprobs(call, tokens)} if call.body.logprobs else None

    def _chunk(self, call: Call, delta: dict[str, Any], finish_reason: str | None,
               logprobs: Any = None) -> dict[str, Any]:
        chunk = {
            "id": call.id,
            "object": "chat.completion.chunk",
            "created": call.created,
            "model": call.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
        }
        if call.body.include_usage:
            chunk["usage"] = None
        return chunk

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        return {
            "id": call.id,
            "object": "chat.completion",
            "created": call.created,
            "model": call.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": completion.text, "refusal": None},
                "finish_reason": oc.finish_reason(completion.finish_reason),
                "logprobs": self._logprobs(call, completion.logprobs),
            }],
            "usage": oc.usage(completion.num_prompt_tokens, completion.num_output_tokens),
        }

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        yield Event(self._chunk(call, {"role": "assistant", "content": ""}, None))
        last = None
        async for out in outputs:
            last = out
            if out.new_text or out.logprobs:
                yield Event(self._chunk(call, {"content": out.new_text}, None, self._logprobs(call, out.logprobs)))
        if last is None:
            return
        yield Event(self._chunk(call, {}, oc.finish_reason(last.finish_reason)))
        if call.body.include_usage:
            yield Event(oc.usage_chunk(self._chunk(call, {}, None), last))
        yield Event("[DONE]")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        return {**oc.client_fields(ask), "messages": [{"role": "user", "content": ask.prompt}]}

    def client_answer(self) -> ChatAnswer:
        return ChatAnswer()


class ChatAnswer(oc.ChoicesAnswer):
    """A client's view of a chat completion: the message's content, or each chunk's delta."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        return (choice["message"] if unary else choice["delta"]).get("content") or ""


@hookimpl
def pagoda_register_protocols(register):
    register(ChatCompletions())
