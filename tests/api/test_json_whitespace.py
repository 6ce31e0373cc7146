"""Compact JSON output against any whitespace, on the structured crowd and the default model: the evidence for the
default (docs/reliability.md, "Structured output: compact by default").

The same clients run on two live servers, one compiling JSON formats compact (the default) and one with any
whitespace (`Grammars(any_whitespace=True)`). Compact must finish at least as many answers within max_tokens as
valid JSON, and spend no more tokens. `pytest -s` prints the table the doc quotes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import jsonschema
import pytest

from pagoda.harness.acceptance import run_crowd
from pagoda.harness.constrained_crowds import CITY_SCHEMA, PROTOCOLS, constrained_crowd
from pagoda.harness.crowd_client import ClientOutcome
from pagoda.simulator.crowd import ClientPlan
from tests.server_fixtures import start_server
from tests.model_fixtures import default_model_dir  # noqa: F401  (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="constrained decoding needs xgrammar"),
]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}}}
# what JSON mode gets from clients like instructor: prompts that ask for a list, a number, a string or nothing
OBJECT_PROMPTS = ["List three colors as a JSON array.", "Reply with a JSON list of the first five prime numbers.",
                  "What is 2 + 2? Reply with the number only.", "Reply with the word hello as a JSON string.",
                  "Is the sky blue? Answer true or false.", "Return [1, 2, 3].",
                  "Write the days of the week as a JSON array of strings.", "Describe a cat as JSON."]
CITY_QUESTION = "Describe Paris as JSON with its city, country and whether it is a capital."


def _sampled(seed: int) -> dict:
    return {"temperature": 0.8, "seed": seed} if seed else {}  # seed 0: greedy


def workloads() -> dict[str, list[ClientPlan]]:
    """The structured crowd's constrained clients, then wider runs of its schema, a free-text schema and JSON mode."""
    city = [ClientPlan(f"city-{p}-{s}", prompt_text=CITY_QUESTION, max_tokens=48, protocol=p, stream=s % 2 == 0,
                       json_schema=json.dumps(CITY_SCHEMA), **_sampled(s)) for p in PROTOCOLS for s in range(8)]
    person = [ClientPlan(f"person-{p}-{s}", prompt_text="Describe a person named Ann, aged 31, who likes chess, as JSON.",
                         max_tokens=64, protocol=p, stream=s % 2 == 1, json_schema=json.dumps(PERSON), **_sampled(s))
              for p in PROTOCOLS for s in range(4)]
    # {"type": "object"} compiles exactly as response_format json_object does
    objects = [ClientPlan(f"object-{i}-{p}", prompt_text=text, max_tokens=64, protocol=p,
                          json_schema='{"type": "object"}') for i, text in enumerate(OBJECT_PROMPTS)
               for p in ("chat", "responses")]
    return {"structured crowd (CITY_SCHEMA, 48 tokens)": [p for p in constrained_crowd() if p.json_schema],
            "CITY_SCHEMA, 4 protocols x 8 seeds (48)": city, "free strings (PERSON), 4 x 4 seeds (64)": person,
            "json_object, 8 prompts x 2 endpoints (64)": objects}


def tally(plans: list[ClientPlan], outcomes: dict[str, ClientOutcome]) -> dict[str, float]:
    """Answers that ended (not cut by max_tokens) as JSON valid against the schema; tokens spent; whitespace."""
    valid, tokens, whitespace = 0, 0, 0
    for plan in plans:
        outcome = outcomes[plan.client_id]
        assert outcome.status == "completed", (plan.client_id, outcome.error)
        tokens += outcome.output_tokens
        whitespace += sum(c in " \n\r\t" for c in outcome.text)
        try:
            jsonschema.validate(json.loads(outcome.text), json.loads(plan.json_schema))
            valid += outcome.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"valid": valid, "of": len(plans), "tokens": tokens, "mean_tokens": round(tokens / len(plans), 1),
            "whitespace": whitespace}


def measure(model_dir, any_whitespace: bool) -> dict[str, dict[str, float]]:
    live = start_server(model_dir, "smollm2", num_blocks=256, block_size=16, max_running=16, max_batched_tokens=512,
                        max_model_len=2048)
    try:
        live.async_engine.engine.grammars.any_whitespace = any_whitespace  # before its first compile
        return {name: tally(plans, asyncio.run(run_crowd(live.url, plans, "smollm2", live.endpoints)).outcomes)
                for name, plans in workloads().items()}
    finally:
        live.server.stop()


def test_compact_json_ends_within_max_tokens_at_least_as_often_and_spends_fewer_tokens(default_model_dir):  # noqa: F811
    compact, loose = measure(default_model_dir, False), measure(default_model_dir, True)
    print("\n| workload | compact: valid, tokens (mean) | any whitespace: valid, tokens (mean) |\n|---|---|---|")
    for name in compact:
        c, a = compact[name], loose[name]
        print(f"| {name} | {c['valid']}/{c['of']}, {c['tokens']} ({c['mean_tokens']}) "
              f"| {a['valid']}/{a['of']}, {a['tokens']} ({a['mean_tokens']}) |")
    for name in compact:
        assert compact[name]["valid"] >= loose[name]["valid"], (name, compact[name], loose[name])
        assert compact[name]["tokens"] <= loose[name]["tokens"], (name, compact[name], loose[name])
    assert sum(c["valid"] for c in compact.values()) > sum(a["valid"] for a in loose.values())
