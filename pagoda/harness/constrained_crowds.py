"""Crowds with constrained clients: some answers must be JSON valid against a schema, on every protocol.

Constrained rows are masked per row, so a crowd that mixes them with free clients (and preempts them mid-JSON)
must still answer each client byte for byte as it answers it alone, and every constrained answer must validate.
"""

from __future__ import annotations

import json

import jsonschema

from collections.abc import Mapping

from pagoda.harness.crowd_client import ClientOutcome
from pagoda.simulator.crowd import ClientPlan

# Bounded fields (enums, a boolean), so even a small model's answer ends when the grammar does.
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                   "country": {"type": "string", "enum": ["France", "United Kingdom", "Japan"]},
                   "capital": {"type": "boolean"}},
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}
PROTOCOLS = ("chat", "responses", "messages", "completions")


def constrained_crowd(max_tokens: int = 48) -> list[ClientPlan]:
    """Per protocol, one client constrained to CITY_SCHEMA and one free; greedy and seeded, streaming and not."""
    schema = json.dumps(CITY_SCHEMA)
    question = "Describe Paris as JSON with its city, country and whether it is a capital."
    plans = []
    for i, protocol in enumerate(PROTOCOLS):
        sampled = dict(temperature=0.8, seed=i) if i % 2 else {}
        plans.append(ClientPlan(f"json-{protocol}", prompt_text=question, max_tokens=max_tokens, protocol=protocol,
                                stream=i % 2 == 0, json_schema=schema, **sampled))
        plans.append(ClientPlan(f"free-{protocol}", prompt_text="Describe Paris in three sentences.",
                                max_tokens=max_tokens, protocol=protocol, stream=i % 2 == 1, **sampled))
    return plans


def check_constrained(plans: list[ClientPlan], outcomes: Mapping[str, ClientOutcome]) -> int:
    """Every completed constrained answer is JSON valid against its plan's schema; returns how many were checked."""
    checked = 0
    for plan in plans:
        outcome = outcomes[plan.client_id]
        if plan.json_schema is None or outcome.status != "completed":
            continue
        try:
            jsonschema.validate(json.loads(outcome.text), json.loads(plan.json_schema))
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"{plan.client_id}: {outcome.text!r} does not match its schema: {exc}") from None
        checked += 1
    return checked
