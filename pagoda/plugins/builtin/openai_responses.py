"""OpenAI responses: POST /v1/responses (input items, instructions, a typed event stream).

The stream follows the event sequence the SDK's `responses.stream()` helper
accumulates: created, in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done,
completed. Every event carries `sequence_number` and the same response id.
A response cut off by max_output_tokens ends with `response.completed` whose
response has status "incomplete" (the helper needs that event to finish).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import ApiError, Call, Completion, Endpoint, Event
from pagoda.plugins.protocol import Generation, RequestError, ServeContext, join_text_parts, make_sampling_params


class InputContent(msgspec.Struct):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: str | list[InputContent] | None = None
    type: str = "message"


class ResponsesRequest(oc.Sampling, kw_only=True):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: oc.PositiveInt | None = None
    top_logprobs: oc.TopLogprobs | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None


def conversation(body: ResponsesRequest) -> list[dict[str, str]]:
    """The chat-template messages: instructions as the system message, then the input items."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input must hold at least one item", "input")
    for i, item in enumerate(body.input):
        if item.type != "message":
            raise RequestError(f"input[{i}]: only message items are supported, got type {item.type!r}",
                               f"input[{i}].type")
        text = join_text_parts(item.content, f"input[{i}].content", ("input_text", "output_text", "text"))
        messages.append(oc.template_message(item.role, text))
    return messages


class Responses(Endpoint):
    name = "openai-responses"
    protocol = "responses"
    path = "/v1/responses"
    body_type = ResponsesRequest
    id_prefix = "resp_"
    errors = oc.OPENAI_ERRORS

    def prepare(self, body: ResponsesRequest, ctx: ServeContext) -> Generation:
        if body.previous_response_id is not None:
            raise RequestError("previous_response_id is not supported: responses are not stored",
                               "previous_response_id")
        ids = ctx.encode_chat(conversation(body))
        params = make_sampling_params(
            {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
            max_tokens=body.max_output_tokens or ctx.default_max_tokens(len(ids)),
            logprobs=body.top_logprobs,
            **body.sampling_fields(),
        )
        return Generation(ids, params, stream=body.stream)

    # -- shapes ----------------------------------------------------------
    def _message_id(self, call: Call) -> str:
        return call.state.setdefault("message_id", f"msg_{secrets.token_hex(12)}")

    def _logprobs(self, call: Call, tokens) -> list[dict[str, Any]]:
        return oc.chat_logprobs(call, tokens) if call.body.top_logprobs is not None else []

    def _part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _message(self, call: Call, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self._message_id(call), "role": "assistant", "status": status,
                "content": content}

    def _response(self, call: Call, status: str, output: list[dict[str, Any]],
                  completion: Completion | None = None) -> dict[str, Any]:
        body: ResponsesRequest = call.body
        cut_off = completion is not None and completion.finish_reason is FinishReason.LENGTH
        return {
            "id": call.id,
            "object": "response",
            "created_at": call.created,
            "model": call.model,
            "status": status,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "metadata": body.metadata or {},
            "text": {"format": {"type": "text"}},
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut_off else None,
            "usage": None if completion is None else _usage(completion.num_prompt_tokens, completion.num_output_tokens),
        }

    def _final(self, call: Call, completion: Completion) -> dict[str, Any]:
        status = "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"
        part = self._part(completion.text, self._logprobs(call, completion.logprobs))
        return self._response(call, status, [self._message(call, status, [part])], completion)

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        return self._final(call, completion)

    # -- stream ----------------------------------------------------------
    def _event(self, call: Call, kind: str, **fields: Any) -> Event:
        seq = call.state.get("sequence_number", 0)
        call.state["sequence_number"] = seq + 1
        return Event({"type": kind, "sequence_number": seq, **fields}, name=kind)

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        at = {"item_id": self._message_id(call), "output_index": 0, "content_index": 0}
        yield self._event(call, "response.created", response=self._response(call, "in_progress", []))
        yield self._event(call, "response.in_progress", response=self._response(call, "in_progress", []))
        yield self._event(call, "response.output_item.added", output_index=0,
                          item=self._message(call, "in_progress", []))
        yield self._event(call, "response.content_part.added", **at, part=self._part("", []))
        seen: list[RequestOutput] = []
        async for out in outputs:
            seen.append(out)
            if out.new_text or out.logprobs:
                yield self._event(call, "response.output_text.delta", **at, delta=out.new_text,
                                  logprobs=self._logprobs(call, out.logprobs))
        if not seen:
            return
        final = self._final(call, Completion.from_outputs(seen))
        message = final["output"][0]
        part = message["content"][0]
        yield self._event(call, "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])
        yield self._event(call, "response.content_part.done", **at, part=part)
        yield self._event(call, "response.output_item.done", output_index=0, item=message)
        yield self._event(call, "response.completed", response=final)

    def render_stream_error(self, call: Call, error: ApiError) -> list[Event]:
        # A top-level "error" object makes the SDK raise mid-stream.
        body = self.errors.render_error(error)["error"]
        return [self._event(call, "error", code=body["code"], message=body["message"], param=body["param"], error=body)]

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        return {**ask.sampling_fields(), "input": ask.prompt, "max_output_tokens": ask.max_tokens}

    def client_answer(self) -> ResponseAnswer:
        return ResponseAnswer()


class ResponseAnswer(ClientAnswer):
    """A client's view of a response: the output text, its status, the usage of the final response."""

    def unary(self, body: dict[str, Any]) -> None:
        self.parts.append("".join(c["text"] for item in body["output"] for c in item.get("content", [])))
        self._final(body)

    def event(self, data: Any) -> None:
        kind = data["type"]
        if kind == "error":
            raise ClientError(data["message"])
        if kind == "response.output_text.delta":
            self.parts.append(data["delta"])
        elif kind == "response.completed":
            self._final(data["response"])

    def _final(self, response: dict[str, Any]) -> None:
        self.finish_reason = "length" if response["status"] == "incomplete" else "stop"
        self.prompt_tokens = response["usage"]["input_tokens"]
        self.output_tokens = response["usage"]["output_tokens"]


def _usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


@hookimpl
def pagoda_register_protocols(register):
    register(Responses())
