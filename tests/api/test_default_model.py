"""The default model behind a live server: real answers through both SDKs, every endpoint, stream and unary."""

import pytest

from tests.server_fixtures import default_model_dir, default_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # greedy, as HF transformers gives it for the same weights


def test_chat_unary_and_stream_helper(default_server):
    client = default_server.openai()
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == 37 and reply.usage.completion_tokens == 8  # 7 tokens + <|im_end|>
    with client.chat.completions.stream(model="smollm2", messages=QUESTION, max_tokens=20, temperature=0) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"


def test_responses_stream_helper(default_server):
    with default_server.openai().responses.stream(model="smollm2", input=QUESTION[0]["content"], max_output_tokens=20,
                                                  temperature=0) as s:
        final = s.get_final_response()
    assert final.output_text == ANSWER and final.status == "completed"
    assert final.usage.input_tokens == 37 and final.usage.output_tokens == 8


def test_anthropic_text_stream_and_stop_sequence(default_server):
    client = default_server.anthropic()
    with client.messages.stream(model="smollm2", max_tokens=20, messages=QUESTION, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == ANSWER and final.stop_reason == "end_turn" and final.usage.output_tokens == 8
    cut = client.messages.create(model="smollm2", max_tokens=20, messages=QUESTION, stop_sequences=["Paris"],
                                 extra_body={"temperature": 0})
    assert cut.content[0].text == "The capital of France is " and cut.stop_sequence == "Paris"
    assert cut.stop_reason == "stop_sequence"


def test_completions_with_logprobs_and_a_length_cut_off(default_server):
    reply = default_server.openai().completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                                       temperature=0, logprobs=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 3
    assert choice.text.startswith(" Paris")
    assert choice.logprobs.tokens[0] == " Paris" and choice.logprobs.token_logprobs[0] > -1.0
    default_server.assert_pool_whole()
