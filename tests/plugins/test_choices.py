"""Several choices without a server: bodies -> one EngineRequest per choice, the merged unary body and stream."""

import asyncio
import contextlib

import pytest

from pagoda.core.request import FinishReason
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.choices import choice_exchange, merge
from tests.helpers import completion, outputs, prepared, read_stream

CHAT = ChatCompletions()
COMPLETIONS = Completions()
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_prompt_list_with_n_makes_prompt_times_n_choices_in_openai_order():
    call = prepared(COMPLETIONS, {"model": "m", "prompt": ["ab", "xyz"], "n": 2, "seed": 10})
    assert [g.prompt_token_ids for g in call.choices] == [[97, 98], [97, 98], [120, 121, 122], [120, 121, 122]]
    assert [g.sampling_params.seed for g in call.choices] == [10, 11, 10, 11]  # choice j: seed + j
    assert all(g.n == 1 for g in call.choices) and call.request is call.choices[0]


def test_a_flat_id_list_is_one_prompt_and_n_without_seed_leaves_seeds_to_the_sampler():
    call = prepared(COMPLETIONS, {"model": "m", "prompt": [5, 6], "n": 3})
    assert [g.prompt_token_ids for g in call.choices] == [[5, 6]] * 3
    assert [g.sampling_params.seed for g in call.choices] == [None] * 3


def test_chat_n_makes_n_choices_of_the_one_conversation():
    call = prepared(CHAT, {"model": "m", "messages": MESSAGES, "n": 2})
    assert len(call.choices) == 2 and call.choices[0].prompt_token_ids == call.choices[1].prompt_token_ids


def test_the_unary_body_holds_every_choice_in_index_order_with_summed_usage():
    call = prepared(COMPLETIONS, {"model": "m", "prompt": ["ab", "cde"], "n": 2, "echo": True})
    texts = [["x"], ["y", "z"], ["u"], ["v", "w", "q"]]
    reply = COMPLETIONS.render_choices(call, [completion(choice_exchange(call, k), t) for k, t in enumerate(texts)])
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in reply["choices"]] == ["abx", "abyz", "cdeu", "cdevwq"]  # each echoes its prompt
    assert reply["usage"]["prompt_tokens"] == 2 + 3  # each prompt once, as OpenAI counts n
    assert reply["usage"]["completion_tokens"] == 1 + 2 + 1 + 3
    assert reply["usage"]["total_tokens"] == 12


def test_chat_unary_choices_each_carry_their_message_and_logprobs():
    call = prepared(CHAT, {"model": "m", "messages": MESSAGES, "n": 2, "logprobs": True})
    reply = CHAT.render_choices(call, [completion(choice_exchange(call, 0), ["A"], logprobs=True),
                                       completion(choice_exchange(call, 1), ["B", "C"], reason=FinishReason.STOP,
                                                  logprobs=True)])
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in reply["choices"]] == \
        [(0, "A", "length"), (1, "BC", "stop")]
    assert [len(c["logprobs"]["content"]) for c in reply["choices"]] == [1, 2]
    assert reply["usage"]["prompt_tokens"] == call.num_prompt_tokens


def streamed(endpoint, call, per_choice):
    """Every event of the merged stream, each choice's outputs fed in turns (so their chunks interleave)."""
    async def feed(outs):
        for out in outs:
            await asyncio.sleep(0)  # hands the loop to the other choices' feeds
            yield out

    async def collect():
        feeds = [feed(outputs(choice_exchange(call, k), texts)) for k, texts in enumerate(per_choice)]
        return [e async for e in endpoint.render_stream_choices(call, feeds)]

    return asyncio.run(collect())


def test_the_stream_interleaves_choices_with_one_finish_each_then_one_usage_and_done():
    call = prepared(CHAT, {"model": "m", "messages": MESSAGES, "n": 2, "stream": True,
                           "stream_options": {"include_usage": True}})
    events = streamed(CHAT, call, [["a", "b", "c"], ["d", "e", "f"]])
    chunks = [e.data for e in events[:-2]]
    indices = [c["choices"][0]["index"] for c in chunks]
    assert indices != sorted(indices)  # interleaved, not one choice after the other
    for k, text in enumerate(["abc", "def"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine) == text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    assert events[-2].data["choices"] == [] and events[-2].data["usage"]["completion_tokens"] == 6
    assert events[-2].data["usage"]["prompt_tokens"] == call.num_prompt_tokens
    assert events[-1].data == "[DONE]" and sum(e.data == "[DONE]" for e in events) == 1


def test_a_completions_prompt_list_streams_each_prompt_as_its_index():
    call = prepared(COMPLETIONS, {"model": "m", "prompt": ["ab", "c", "de"], "stream": True})
    events = streamed(COMPLETIONS, call, [["x", "y"], ["z"], ["w", "v"]])
    texts = {k: "".join(e.data["choices"][0]["text"] for e in events[:-1] if e.data["choices"][0]["index"] == k)
             for k in range(3)}
    assert texts == {0: "xy", 1: "z", 2: "wv"} and events[-1].data == "[DONE]"
    assert not any(e.data != "[DONE]" and e.data.get("usage") for e in events)  # no include_usage


def test_the_client_half_reads_a_merged_stream_without_error():
    call = prepared(COMPLETIONS, {"model": "m", "prompt": "ab", "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}})
    answer = read_stream(COMPLETIONS, streamed(COMPLETIONS, call, [["x"], ["y"]]))
    assert answer.output_tokens == 2 and answer.prompt_tokens == 2


def test_merge_raises_the_first_failure_and_closes_the_others():
    closed = []

    async def ok():
        try:
            while True:
                await asyncio.sleep(0)
                yield 1
        finally:
            closed.append("ok")

    async def bad():
        await asyncio.sleep(0)
        raise RuntimeError("boom")
        yield  # an async generator

    async def main():
        async with contextlib.aclosing(merge([ok(), bad()])) as items:
            async for _ in items:
                pass

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(main())
    assert closed == ["ok"]
