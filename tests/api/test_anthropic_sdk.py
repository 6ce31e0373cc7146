"""Anthropic messages against a live server, with the official `anthropic` SDK as the client."""

import anthropic
import httpx
import pytest

from tests.server_fixtures import default_model_dir, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]
GREEDY = {"temperature": 0}  # newer SDKs take sampling fields only as extra body


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.anthropic()


@pytest.fixture(scope="module")
def reference(client, tiny_server):
    """The greedy unary reply (24 tokens) and a stop sequence from its middle."""
    message = client.messages.create(model=tiny_server.model_name, max_tokens=24, messages=MESSAGES, extra_body=GREEDY)
    text = message.content[0].text
    k = len(text) // 2
    while not text[k : k + 3].strip() or text.find(text[k : k + 3]) != k:
        k += 1
    return message, text, text[k : k + 3]


def test_unary_message_shape_and_usage(reference, tiny_server):
    message, text, _ = reference
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == tiny_server.model_name
    assert [b.type for b in message.content] == ["text"] and text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    prompt = tiny_server.async_engine.engine.tokenizer.encode_chat(MESSAGES)
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == 24


def test_stream_helpers_agree_with_unary(client, reference, tiny_server):
    message, text, _ = reference
    with client.messages.stream(model=tiny_server.model_name, max_tokens=24, messages=MESSAGES, extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == text and len(pieces) > 5
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24
    # the same prompt again: Anthropic's input_tokens leaves out what was read from the prefix cache
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == message.usage.input_tokens
    assert final.id.startswith("msg_")


def test_raw_event_sequence(client, tiny_server):
    events = list(client.messages.create(model=tiny_server.model_name, max_tokens=6, messages=MESSAGES, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]  # (the SDK drops our ping)
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[-2].usage.output_tokens == 6


def test_stop_sequence_is_reported_with_the_sequence(client, reference, tiny_server):
    _, text, stop = reference
    kw = dict(model=tiny_server.model_name, max_tokens=24, messages=MESSAGES, stop_sequences=["never-here", stop],
              extra_body=GREEDY)
    message = client.messages.create(**kw)
    assert message.content[0].text == text[: text.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.usage.output_tokens < 24
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].text == message.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_system_prompt_and_text_blocks(client, tiny_server):
    tokenizer = tiny_server.async_engine.engine.tokenizer
    message = client.messages.create(
        model=tiny_server.model_name, max_tokens=4, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story about a pagoda."}]}],
        extra_body=GREEDY,
    )
    conversation = [{"role": "system", "content": "Be brief."}] + MESSAGES
    assert message.usage.input_tokens == len(tokenizer.encode_chat(conversation))


def test_top_k_and_seed_extensions(client, reference, tiny_server):
    _, text, _ = reference

    def sample(**extra):
        message = client.messages.create(model=tiny_server.model_name, max_tokens=24, messages=MESSAGES,
                                         extra_body={"temperature": 1.0, "seed": 11, **extra})
        return message.content[0].text

    assert sample() == sample() != text
    assert sample(top_k=1) == text


@pytest.mark.parametrize("body, field", [
    ({"model": "m", "messages": MESSAGES}, "max_tokens"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"model": "m", "messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "messages[0].role"),
    ({"model": "m", "messages": [], "max_tokens": 5}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5},
     "messages.0.content.0"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
])
def test_a_bad_field_is_a_400_naming_it_in_anthropics_shape(tiny_server, body, field):
    r = httpx.post(tiny_server.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert field in payload["error"]["message"], payload


def test_errors_reach_the_sdk_and_the_server_keeps_serving(client, tiny_server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=tiny_server.model_name, max_tokens=5000, messages=MESSAGES)
    assert "context" in str(info.value)
    with pytest.raises(anthropic.BadRequestError):
        with client.messages.stream(model=tiny_server.model_name, max_tokens=5000, messages=MESSAGES) as s:
            s.get_final_message()
    ok = client.messages.create(model=tiny_server.model_name, max_tokens=3, messages=MESSAGES, extra_body=GREEDY)
    assert ok.usage.output_tokens == 3
    tiny_server.assert_pool_whole()


def test_models_list(client, tiny_server):
    assert [m.id for m in client.models.list().data] == [tiny_server.model_name]
