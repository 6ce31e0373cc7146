"""What `pagoda bench serve` asks: prompts for one-shot requests, and conversations for the chat workload.

A prompt is text plus its fixed output length. The synthetic words are common
English words that each encode to one token in Llama-family vocabularies
(checked on SmolLM2's), so `--input-len N` words is about N prompt tokens on
any server; the records keep the prompt tokens each server reports.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from pagoda.simulator.crowd import load_crowd

WORKLOADS = ("synthetic", "paragraphs", "crowd", "chat")

WORDS = tuple("""time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house service
friend father power hour game line end member law car city community name president team minute idea kid body
information back parent face level office door health person art war history party result change morning reason
research girl moment air teacher force education river garden music light stone bridge window market letter paper
table field horse apple green small large early young important public same able""".split())

TOPICS = ("the ocean", "volcanoes", "the history of tea", "honeybees", "the moon landing", "jazz music",
          "mountain climbing", "the printing press", "rain forests", "chess", "the Roman empire", "glaciers",
          "bicycles", "coral reefs", "the invention of paper", "lighthouses")


@dataclass(frozen=True)
class Prompt:
    """One request's input: text (a completion prompt or a chat user message) and its fixed output length."""

    text: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """One chat client: a system prompt shared by every conversation, and its user messages, one per turn."""

    system: str
    user_turns: tuple[str, ...]
    think_s: tuple[float, ...] = ()  # the user's pause before each turn (empty: none), as a person reads and types


def words(n: int, rng: random.Random) -> str:
    """`n` random one-token words."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def synthetic(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
    """`num_prompts` distinct prompts of `input_len` random words."""
    rng = random.Random(seed)
    return [Prompt(words(input_len, rng), output_len) for _ in range(num_prompts)]


def paragraphs(output_len: int) -> list[Prompt]:
    """The fixed list: "Write a detailed paragraph about X." for 16 topics."""
    return [Prompt(f"Write a detailed paragraph about {topic}.", output_len) for topic in TOPICS]


def from_crowd(path: str | Path) -> list[Prompt]:
    """A simulator crowd file's prompts and output lengths (arrivals and hang-ups are the load's business)."""
    prompts = []
    for plan in load_crowd(path):
        text = plan.prompt_text or words(plan.prompt_len, random.Random(zlib.crc32(plan.client_id.encode())))
        prompts.append(Prompt(text, plan.max_tokens))
    return prompts


def conversations(num: int, turns: int, system_tokens: int, user_tokens: int, seed: int,
                  think_s: float = 0.0) -> list[Conversation]:
    """`num` conversations of `turns` user messages each, all behind one system prompt (the shared prefix).

    With `think_s` > 0 each turn (the first too) waits an exponential pause of that mean before it is sent, so
    conversations drift apart as real users' do instead of running in lockstep; drawn from a stream of their
    own, so the words are those of the same seed without pauses."""
    rng, pauses = random.Random(seed), random.Random(f"think-{seed}")
    system = "You are a helpful assistant. " + words(system_tokens, rng)
    convs = [Conversation(system, tuple(f"Tell me about {words(user_tokens, rng)}." for _ in range(turns)))
             for _ in range(num)]
    if think_s <= 0:
        return convs
    return [Conversation(c.system, c.user_turns, tuple(pauses.expovariate(1 / think_s) for _ in range(turns)))
            for c in convs]


def prompts_for(workload: str, *, num_requests: int, input_len: int, output_len: int, seed: int,
                crowd: str | None) -> list[Prompt]:
    """The prompts of a one-shot workload; request i sends prompts[i % len(prompts)]."""
    if workload == "synthetic":
        return synthetic(num_requests, input_len, output_len, seed)
    if workload == "paragraphs":
        return paragraphs(output_len)
    if workload == "crowd":
        if not crowd:
            raise ValueError("the crowd workload needs --crowd FILE.json")
        prompts = from_crowd(crowd)
        if not prompts:
            raise ValueError(f"{crowd} holds no client plans")
        return prompts
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
