"""The acceptance crowds: who is in them, and which of them hang up (run by pagoda/harness/acceptance.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagoda.harness.crowd_client import ClientOutcome
from pagoda.simulator.crowd import ClientPlan

TINY_PROMPTS = (
    "Tell me about the sea.",
    "List three colours and a number.",
    "Why is the sky blue? Answer briefly, please.",
    "Write a haiku about paged memory.",
    "What is 17 times 3?",
    "Name a river in Africa and one in Asia.",
    "Describe a pagoda in one sentence.",
    "Give me a word that rhymes with cache.",
    "Count from one to five.",
    "What do bees make?",
    "Translate 'good morning' to French.",
    "Summarise the plot of a fairy tale.",
)


def tiny_crowd(protocols: Sequence[str], max_tokens: int = 40) -> list[ClientPlan]:
    """At least 12 clients, at least two per protocol: each protocol streaming and unary, a third greedy,
    3 that will hang up.

    Client i speaks protocols[i % n] and streams when (i % n + i // n) is even, so each protocol's
    clients alternate between streaming and unary and half the crowd streams.
    """
    n = len(protocols)
    greedy = {0, 5, 10, 7}
    samplers = [dict(temperature=0.8), dict(temperature=1.0, top_k=40), dict(temperature=0.7, top_p=0.9),
                dict(temperature=0.9, top_k=5, top_p=0.8)]
    plans = []
    for i in range(max(12, 2 * n)):
        sampling = {} if i % 12 in greedy else {**samplers[i % len(samplers)], "seed": 1000 + i}
        plans.append(ClientPlan(client_id=f"t{i:02d}", arrival=0.004 * i, prompt_text=TINY_PROMPTS[i % 12],
                                max_tokens=max_tokens, stream=(i % n + i // n) % 2 == 0, protocol=protocols[i % n],
                                **sampling))
    return plans


TINY_HANGUPS = ("t02", "t06", "t11")  # three clients on three protocols, streaming and unary


def with_hangups(plans: list[ClientPlan], solo: dict[str, ClientOutcome], client_ids=TINY_HANGUPS) -> list[ClientPlan]:
    """The named clients hang up half-way: at half the time their request took alone."""
    return [dataclasses.replace(p, hangup_after=round(solo[p.client_id].seconds / 2, 4)) if p.client_id in client_ids
            else p for p in plans]


def default_model_crowd(max_tokens: int = 40) -> list[ClientPlan]:
    """Four clients on the default model that disagree about sampling, on four protocols."""
    question = "Describe Paris in three sentences."
    return [
        ClientPlan("greedy", prompt_text=question, max_tokens=max_tokens, protocol="chat", stream=True),
        ClientPlan("seed0", prompt_text=question, max_tokens=max_tokens, protocol="responses", temperature=0.8, seed=0),
        ClientPlan("seed1", prompt_text=question, max_tokens=max_tokens, protocol="messages", temperature=0.8, seed=1,
                   stream=True),
        ClientPlan("topk40", prompt_text="Paris is a city that", max_tokens=max_tokens, protocol="completions",
                   temperature=1.0, top_k=40, seed=7),
    ]
