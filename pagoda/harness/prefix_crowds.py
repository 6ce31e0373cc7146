"""Live crowds for the prefix cache: one shared system prompt, and conversations whose turns extend each other.

Every first turn begins with the same long instructions (sent as the start of the user text, so the plain
completions endpoint shares them too); some clients go on for one or two more turns (`after`), each
sending the whole conversation so far. The cache should find, for every follow-up, at least the
conversation's first block: it was written by the turn before, which had just finished, and is the
coldest block of nobody's table (a table is freed last block first, so a prefix's head outlives its tail).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.simulator.crowd import ClientPlan

SHARED_INSTRUCTIONS = (
    "You are the guide of an old pagoda on a hill. Answer visitors in short, kind sentences, mention the bell "
    "when it fits, never invent dates, and keep every answer about the pagoda, its garden or the river below. "
)
QUESTIONS = (
    "How tall is the pagoda?", "When does the bell ring?", "What grows in the garden?", "Can I see the river?",
    "Who built the roof?", "Is there a tea room?", "How many steps lead up?", "What is the lantern for?",
)
FOLLOW_UPS = ("Tell me more.", "Why is that?", "And after that?", "Thank you, one more thing?")


def shared_prefix_chat_crowd(protocols: Sequence[str], max_tokens: int = 24) -> list[ClientPlan]:
    """Eight first turns behind one shared instruction text, four of them followed by a second turn and two by a
    third; every protocol both streaming and unary, half greedy and half seeded sampling."""
    n = len(protocols)
    plans = []
    for i, question in enumerate(QUESTIONS):
        sampling = {} if i % 2 == 0 else {"temperature": 0.8, "top_k": 40, "seed": 2000 + i}
        plans.append(ClientPlan(client_id=f"p{i}-t0", arrival=0.005 * i, prompt_text=SHARED_INSTRUCTIONS + question,
                                max_tokens=max_tokens, protocol=protocols[i % n], stream=(i // n) % 2 == 0,
                                **sampling))
    for i in range(4):  # second turns, each on its conversation's protocol, the other way of streaming
        first = plans[i]
        plans.append(ClientPlan(client_id=f"p{i}-t1", arrival=0.01, prompt_text=FOLLOW_UPS[i], max_tokens=max_tokens,
                                protocol=first.protocol, stream=not first.stream, temperature=first.temperature,
                                top_k=first.top_k, seed=None if first.seed is None else first.seed + 1,
                                after=first.client_id))
    for i in range(2):  # third turns
        plans.append(ClientPlan(client_id=f"p{i}-t2", arrival=0.01, prompt_text=FOLLOW_UPS[(i + 2) % 4],
                                max_tokens=max_tokens, protocol=plans[i].protocol, stream=plans[i].stream,
                                after=f"p{i}-t1"))
    return plans


def predicted_hit_tokens(plans: Sequence[ClientPlan], completed: set[str], block_size: int) -> int:
    """The prefix-cache hits the crowd's shape guarantees: a block for every completed follow-up turn."""
    return block_size * sum(1 for p in plans if p.after is not None and p.client_id in completed)


def default_model_prefix_crowd(max_tokens: int = 32) -> list[ClientPlan]:
    """Four clients on the default model: three questions behind the shared instructions on three protocols, then
    a second turn of the greedy chat, on the fourth. The first turns ignore EOS, so that they run to `max_tokens`
    and press on the pool."""
    first = [
        ClientPlan("chat-t0", prompt_text=SHARED_INSTRUCTIONS + QUESTIONS[0], max_tokens=max_tokens, protocol="chat",
                   stream=True, ignore_eos=True),
        ClientPlan("messages", arrival=0.01, prompt_text=SHARED_INSTRUCTIONS + QUESTIONS[1], max_tokens=max_tokens,
                   protocol="messages", temperature=0.8, seed=1, ignore_eos=True),
        ClientPlan("completions", arrival=0.02, prompt_text=SHARED_INSTRUCTIONS + QUESTIONS[2], max_tokens=max_tokens,
                   protocol="completions", stream=True, temperature=0.8, top_k=40, seed=2, ignore_eos=True),
    ]
    return first + [ClientPlan("chat-t1", arrival=0.01, prompt_text=FOLLOW_UPS[0], max_tokens=max_tokens,
                               protocol="responses", after="chat-t0")]
