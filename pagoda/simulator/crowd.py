"""Crowds: lists of client plans, saved and replayed as JSON.

One format serves the simulator and the live acceptance harness: a plan says
when a client arrives, what it asks, how it samples, whether it streams, which
protocol it speaks (live runs only) and when, if ever, it hangs up.

A plan's `protocol` is the name of a registered endpoint's protocol
("completions", "chat", "responses", "messages", or a plugin's, such as
"ollama-chat"). The simulator does not speak protocols, so it only checks the
name is a string; the live harness resolves it against the server's endpoints.

A plan may name a LoRA adapter (`adapter`): its rows add that adapter's deltas
(the simulator loads every adapter its crowd names). A plan that names none
runs on the base model.

A plan may follow another (`after`): the next turn of a chat or the next step
of an agent. It arrives `arrival` seconds after that client has left, and its
prompt is that client's prompt + the output it received + its own `prompt`, so
prompts grow turn by turn and every turn extends the one before.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import msgspec

from pagoda.core.sampling_params import SamplingParams

# A plan's token ids are below this: past every real model's vocabulary (Gemma 3's is 2**18), and the most the fake
# model's logit table (256 rows of the vocabulary, simulator/fake_model.py) is widened to hold: 512 MiB.
TOKEN_ID_LIMIT = 2**19


@dataclass(frozen=True)
class ClientPlan:
    client_id: str
    arrival: float = 0.0  # seconds after the crowd starts
    prompt_len: int = 8  # used when neither prompt tokens nor text are given
    prompt: tuple[int, ...] | None = None  # token ids
    prompt_text: str | None = None  # live runs on a real model
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    protocol: str | None = None  # live runs: a registered endpoint's protocol name
    hangup_after: float | None = None  # seconds after arrival; None = stays
    after: str | None = None  # a follow-up of this client: `arrival` counts from when it left
    cache_salt: str | None = None  # prefix-cache keys: blocks are shared only under equal ones
    tenant: str | None = None  # who the client is for: the fair scheduling policy's unit
    priority: int = 0  # the priority policy's order: lower runs first
    weight: float = 1.0  # its tenant's weight under the fair policy
    json_schema: str | None = None  # live runs: the answer must be JSON valid against this schema (its JSON text)
    adapter: str | None = None  # the LoRA adapter its rows add (None: the base model); its KV is its own

    def __post_init__(self) -> None:
        if self.prompt is not None:
            object.__setattr__(self, "prompt", tuple(self.prompt))
            bad = next((t for t in self.prompt if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT), None)
            if bad is not None:
                raise ValueError(f"prompt: token id {bad!r} is not an integer in [0, {TOKEN_ID_LIMIT})")
        if self.after is None and self.prompt == ():
            raise ValueError("prompt is empty: a client that follows no other needs at least one prompt token")
        if self.after is None and self.prompt is None and self.prompt_text is None and self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1 for a generated prompt, got {self.prompt_len}")
        if self.protocol is not None and not (isinstance(self.protocol, str) and self.protocol):
            raise ValueError(f"protocol must be an endpoint's protocol name, got {self.protocol!r}")
        if self.hangup_after is not None and self.hangup_after < 0:
            raise ValueError(f"hangup_after must be >= 0, got {self.hangup_after}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not self.weight > 0:
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise ValueError(f"adapter must be a LoRA adapter's name (a non-empty string) or null, got {self.adapter!r}")
        self.sampling_params()  # validate the sampling fields now

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    def prompt_token_ids(self, vocab_size: int) -> list[int]:
        """The plan's prompt tokens; generated from the client id when not given (never token 0, EOS)."""
        if self.prompt is not None:
            return list(self.prompt)
        rng = random.Random(zlib.crc32(self.client_id.encode()))
        return [rng.randrange(1, vocab_size) for _ in range(self.prompt_len)]

    def alone(self) -> ClientPlan:
        """The same plan arriving at once and never hanging up: the solo baseline."""
        return replace(self, arrival=0.0, hangup_after=None)


def mixed_crowd(
    seed: int,
    clients: int = 12,
    hangup_fraction: float = 0.25,
    max_prompt_len: int = 64,
    max_tokens: int = 48,
    arrival_window: float = 1.0,
    protocols: tuple[str, ...] | None = None,
) -> list[ClientPlan]:
    """A crowd that disagrees about everything: lengths, sampling, streaming, arrival, hang-ups."""
    rng = random.Random(seed)
    hangups = set(rng.sample(range(clients), round(clients * hangup_fraction)))
    plans = []
    for i in range(clients):
        sampled = rng.random() < 0.6
        plans.append(
            ClientPlan(
                client_id=f"c{i:04d}",
                arrival=round(rng.uniform(0, arrival_window), 4),
                prompt_len=rng.randint(2, max_prompt_len),
                max_tokens=rng.randint(1, max_tokens),
                temperature=round(rng.uniform(0.5, 1.3), 2) if sampled else 0.0,
                top_k=rng.choice((0, 0, 5, 40)) if sampled else 0,
                top_p=rng.choice((1.0, 1.0, 0.9, 0.5)) if sampled else 1.0,
                seed=rng.randrange(2**31) if sampled else None,
                stream=rng.random() < 0.5,
                protocol=protocols[i % len(protocols)] if protocols else None,
                hangup_after=round(rng.uniform(0.0, 0.3), 4) if i in hangups else None,
            )
        )
    return plans


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab_size) for _ in range(n))  # never token 0, the fake model's EOS


def shared_prefix_crowd(
    seed: int, clients: int = 12, system_len: int = 48, max_question_len: int = 16, max_tokens: int = 16,
    arrival_gap: float = 0.25, tenants: int = 1, vocab_size: int = 256,
) -> list[ClientPlan]:
    """Clients one after another, each with its tenant's one system prompt and a question of its own."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab_size) for _ in range(tenants)]
    plans = []
    for i in range(clients):
        t = i % tenants
        plans.append(ClientPlan(
            client_id=f"s{i:04d}", arrival=round(i * arrival_gap, 4),
            prompt=systems[t] + _tokens(rng, rng.randint(1, max_question_len), vocab_size),
            max_tokens=rng.randint(1, max_tokens), tenant=f"tenant{t}" if tenants > 1 else None,
        ))
    return plans


def chat_crowd(
    seed: int, chats: int = 4, turns: int = 3, system_len: int = 24, max_turn_len: int = 12, max_tokens: int = 12,
    think_time: float = 0.05, arrival_window: float = 0.5, vocab_size: int = 256,
) -> list[ClientPlan]:
    """Multi-turn chats: each turn's prompt is the previous turn's prompt and answer plus a new message."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab_size)
    plans = []
    for c in range(chats):
        for t in range(turns):
            message = _tokens(rng, rng.randint(1, max_turn_len), vocab_size)
            plans.append(ClientPlan(
                client_id=f"chat{c:03d}-t{t}", arrival=round(rng.uniform(0, arrival_window), 4) if t == 0 else think_time,
                prompt=system + message if t == 0 else message, max_tokens=rng.randint(1, max_tokens),
                after=f"chat{c:03d}-t{t - 1}" if t else None,
            ))
    return plans


def agent_crowd(
    seed: int, agents: int = 6, preambles: int = 2, preamble_len: int = 96, max_task_len: int = 12, steps: int = 3,
    max_tokens: int = 10, tool_time: float = 0.02, arrival_window: float = 0.5, vocab_size: int = 256,
) -> list[ClientPlan]:
    """Agents: a long tool preamble (one of a few), a task, then tool results fed back step by step."""
    rng = random.Random(seed)
    tools = [_tokens(rng, preamble_len, vocab_size) for _ in range(preambles)]
    plans = []
    for a in range(agents):
        preamble = tools[rng.randrange(preambles)]
        for s in range(steps):
            new = _tokens(rng, rng.randint(1, max_task_len), vocab_size)  # the task, then a tool's result
            plans.append(ClientPlan(
                client_id=f"agent{a:03d}-s{s}", arrival=round(rng.uniform(0, arrival_window), 4) if s == 0 else tool_time,
                prompt=preamble + new if s == 0 else new, max_tokens=rng.randint(1, max_tokens), ignore_eos=True,
                after=f"agent{a:03d}-s{s - 1}" if s else None,
            ))
    return plans


def noisy_neighbour_crowd(
    seed: int, streams: int = 64, turns: int = 8, neighbour_turns: int = 8, prompt_len: int = 8,
    max_tokens: int = 16, weights: tuple[float, float] = (1.0, 1.0), vocab_size: int = 256, pause: float = 0.0,
) -> list[ClientPlan]:
    """Tenant "A" keeps `streams` streams open in closed loops (each stream's next request is sent `pause` seconds
    after its last ends, `turns` requests per stream); tenant "B" sends one request at a time (`neighbour_turns` of
    them, with the same pause).
    Each stream is a chat (a follow-up's prompt is the last prompt, its answer and a new message); answers ignore
    EOS. Each turn has its own cache salt, so it computes its whole prompt as its solo rerun does: the TTFT alone
    (`tenants[...]["ttft_alone_p50"]`) compares like with like."""
    rng = random.Random(seed)
    plans = []
    for name, num_streams, num_turns, weight in (("A", streams, turns, weights[0]), ("B", 1, neighbour_turns, weights[1])):
        for s in range(num_streams):
            for t in range(num_turns):
                plans.append(ClientPlan(
                    client_id=f"{name}{s:03d}-t{t:03d}", arrival=pause if t else 0.0,
                    prompt=_tokens(rng, prompt_len, vocab_size),
                    max_tokens=max_tokens, ignore_eos=True, tenant=name, weight=weight, cache_salt=f"{name}{s:03d}-t{t:03d}",
                    after=f"{name}{s:03d}-t{t - 1:03d}" if t else None,
                ))
    return plans


def with_adapters(plans: list[ClientPlan], adapters: tuple[str, ...]) -> list[ClientPlan]:
    """The crowd with its conversations spread over the base model and `adapters` in turn: the k-th plan that
    follows no other asks for (None, *adapters)[k % (len(adapters) + 1)], and a follow-up for what the plan it
    follows asked for (a chat goes on under its adapter)."""
    choices: tuple[str | None, ...] = (None, *adapters)
    chosen: dict[str, str | None] = {}
    out, first_turns = [], 0
    for plan in plans:
        if plan.after is None:
            adapter, first_turns = choices[first_turns % len(choices)], first_turns + 1
        else:
            adapter = chosen[plan.after]
        chosen[plan.client_id] = adapter
        out.append(replace(plan, adapter=adapter))
    return out


def crowd_to_json(plans: list[ClientPlan]) -> str:
    return json.dumps([{k: v for k, v in asdict(p).items() if v is not None} for p in plans], indent=1)


def crowd_from_json(text: str) -> list[ClientPlan]:
    """Parse a crowd; every error is a ValueError naming the plan (its place and client id) and the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a crowd is JSON, and this is not: {exc}") from None
    if not isinstance(data, list):
        raise ValueError("a crowd is a JSON list of client plans")
    known = {f.name for f in fields(ClientPlan)}
    plans: list[ClientPlan] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"crowd[{i}] must be an object")
        where = f"crowd[{i}] (client {item.get('client_id')!r})"
        unknown = set(item) - known
        if unknown:
            raise ValueError(f"{where} has unknown fields: {sorted(unknown)}")
        try:
            plans.append(msgspec.convert(item, ClientPlan))  # each field's JSON type, then ClientPlan's own checks
        except msgspec.ValidationError as exc:
            raise ValueError(f"{where}: {_field_error(str(exc))}") from None
    seen: dict[str, int] = {}
    for i, plan in enumerate(plans):
        if plan.client_id in seen:
            raise ValueError(f"crowd[{i}] (client {plan.client_id!r}): client_id is crowd[{seen[plan.client_id]}]'s "
                             "too; client_id values in a crowd must be unique")
        if plan.after is not None and plan.after not in seen:
            raise ValueError(f"crowd[{i}] (client {plan.client_id!r}): after: it follows {plan.after!r}, which is not "
                             "an earlier client")
        seen[plan.client_id] = i
    return plans


def _field_error(message: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.max_tokens`" as "max_tokens: expected `int`, got `str`"; a
    plan's own check names its field already."""
    what, at, where = message.rpartition(" - at `$.")
    return f"{where.rstrip('`')}: {what[:1].lower()}{what[1:]}" if at else message


def load_crowd(path: str | Path) -> list[ClientPlan]:
    return crowd_from_json(Path(path).read_text())
