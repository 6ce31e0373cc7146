"""JSON mode answers with an object, as OpenAI's does: the default model on a live server, through the openai SDK.

instructor's JSON mode got a list back when `{"type": "json_object"}` compiled any JSON. These prompts ask for a
list, a number, a string or a boolean; the constraint must still give an object, on chat and responses, unary and
streamed.
"""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_fixtures import default_server  # noqa: F401  (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="constrained decoding needs xgrammar"),
]

# Prompts the default model answers greedily with a list, a number or a string, or in endless indentation, when any
# JSON value and any whitespace are allowed (the grammar before this fix); a compact object ends well within the limit.
NOT_OBJECTS = [
    "What is 2 + 2? Reply with the number only.",  # any JSON: [2, 2]
    "Is the sky blue? Answer true or false.",  # [1]
    "What is the capital of France? Answer in one word.",  # [false]
    "How many legs does a dog have? Reply with a number.",  # [10]
    "Say hi.",  # [null]
    'Reply with ["a", "b"].',  # [1, "a", "b"]
    "Give me a JSON array with the numbers 1, 2 and 3.",  # an object indented until max_tokens
    "Return the JSON value [true, false].",  # likewise
]
MAX_TOKENS = 96


def chat(server, prompt: str, stream: bool) -> tuple[str, str]:
    client = server.openai()
    fields = dict(model=server.model_name, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                  temperature=0, response_format={"type": "json_object"})
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        return choice.message.content, choice.finish_reason
    with client.chat.completions.stream(**fields) as events:
        choice = events.get_final_completion().choices[0]
    return choice.message.content, choice.finish_reason


def responses(server, prompt: str, stream: bool) -> tuple[str, str]:
    client = server.openai()
    fields = dict(model=server.model_name, input=prompt, max_output_tokens=MAX_TOKENS, temperature=0,
                  text={"format": {"type": "json_object"}})
    if not stream:
        reply = client.responses.create(**fields)
    else:
        with client.responses.stream(**fields) as events:
            reply = events.get_final_response()
    return reply.output_text, reply.status


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("ask", [chat, responses], ids=["chat", "responses"])
def test_json_object_is_an_object_whatever_the_prompt_asks_for(default_server, ask, stream):  # noqa: F811
    with ThreadPoolExecutor(len(NOT_OBJECTS)) as pool:
        answers = list(pool.map(lambda prompt: ask(default_server, prompt, stream), NOT_OBJECTS))
    for prompt, (text, finish) in zip(NOT_OBJECTS, answers):
        assert finish in ("stop", "completed"), (prompt, text, finish)
        assert isinstance(json.loads(text), dict), (prompt, text)
    default_server.assert_pool_whole()

