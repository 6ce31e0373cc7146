"""Request shapes the real APIs refuse, found by a hostile corpus: a 400 in the protocol's own shape naming the field,
through the official SDKs, and the server keeps serving with its pool whole.

- a completions `prompt` mixing token ids and text (OpenAI takes str, [str], [int] or [[int]], never a mix);
- an Anthropic message with empty content ("all messages must have non-empty content except for the optional
  final assistant message") or an empty text block ("text content blocks must be non-empty").
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server_fixtures import tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

GREEDY = {"temperature": 0}


@pytest.mark.parametrize("prompt", [
    [[1, 2], "x"], ["x", [1, 2]], [1, "x"], ["x", 1], [[1, 2], "x", [3]], [[1, 2], 3], [3, [1, 2]],
], ids=repr)
def test_a_prompt_mixing_token_ids_and_text_is_a_400_naming_prompt(tiny_server, prompt):  # noqa: F811
    client = tiny_server.openai()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            reply = client.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=2, stream=stream)
            list(reply) if stream else None
        assert info.value.param == "prompt" and info.value.type == "invalid_request_error", info.value.body
        assert "prompt" in info.value.message
    tiny_server.assert_pool_whole()


@pytest.mark.parametrize(("prompt", "num_choices"), [
    ("Hello", 1), (["Hello"], 1), (["Hello", "there"], 2), ([1, 2, 3], 1), ([[1, 2], [3, 4, 5]], 2),
], ids=repr)
def test_the_prompt_shapes_openai_takes_still_work(tiny_server, prompt, num_choices):  # noqa: F811
    reply = tiny_server.openai().completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=2,
                                                    extra_body=GREEDY)
    assert len(reply.choices) == num_choices and all(c.finish_reason == "length" for c in reply.choices)


def _refused(client, model: str, messages: list, stream: bool) -> anthropic.BadRequestError:
    with pytest.raises(anthropic.BadRequestError) as info:
        if stream:
            with client.messages.stream(model=model, max_tokens=2, messages=messages) as events:
                events.get_final_message()
        else:
            client.messages.create(model=model, max_tokens=2, messages=messages)
    return info.value


@pytest.mark.parametrize(("messages", "named", "why"), [
    ([{"role": "user", "content": []}], "messages.0", "non-empty content"),
    ([{"role": "user", "content": ""}], "messages.0", "non-empty content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "Go"}],
     "messages.1", "non-empty content"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0",
     "text content blocks must be non-empty"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}],
     "messages.0.content.1", "text content blocks must be non-empty"),
], ids=["empty-list", "empty-string", "empty-earlier-assistant", "empty-text-block", "empty-second-block"])
def test_an_empty_message_or_text_block_is_a_400_naming_it(tiny_server, messages, named, why):  # noqa: F811
    client = tiny_server.anthropic()
    for stream in (False, True):
        error = _refused(client, tiny_server.model_name, messages, stream)
        assert error.status_code == 400 and error.body["error"]["type"] == "invalid_request_error", error.body
        message = error.body["error"]["message"]
        assert message.startswith(f"{named}: ") and why in message, message
    ok = client.messages.create(model=tiny_server.model_name, max_tokens=2, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hi"}])
    assert ok.usage.output_tokens == 2
    tiny_server.assert_pool_whole()


def test_an_empty_final_assistant_message_is_allowed_as_anthropic_allows_it(tiny_server):  # noqa: F811
    reply = tiny_server.anthropic().messages.create(
        model=tiny_server.model_name, max_tokens=2, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])
    assert reply.stop_reason == "max_tokens"
