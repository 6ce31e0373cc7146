"""A fuzzer over the four protocol routes of a real server: a 4xx in the protocol's shape or a valid answer.

Bodies are drawn from the endpoints' own msgspec body structs (`msgspec.inspect`: each field's type and
bounds), then some are mutated: a field's value swapped for a hostile one (a number as a string, 2**70,
deep nesting, lone surrogates, a wrong type), a required field dropped, an unknown field added, or the body
replaced by something that is not an object. Never a 5xx; a 200 is a well-formed answer (a stream ends
without an error event). Meanwhile a bystander greedy stream runs again and again and must match its solo
run byte for byte, and the pool is whole at the end.

CI runs FUZZ_CASES cases (150, well under a minute on 2 cores); HYPOTHESIS_PROFILE=deep runs 5,000.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import httpx
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.api.settings import ServeSettings
from pagoda.plugins.builtin.anthropic_messages import MessagesRequest
from pagoda.plugins.builtin.openai_chat import ChatRequest
from pagoda.plugins.builtin.openai_completions import CompletionRequest
from pagoda.plugins.builtin.openai_responses import ResponsesRequest
from tests.server_fixtures import TINY_ENGINE, start_server, tiny_model_dir  # noqa: F401

FUZZ_CASES = 5_000 if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else 150
NAME = "tiny-fuzz"
ROUTES = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest}
# Output lengths stay small so a case costs milliseconds; the bounds of every other field are the struct's.
SMALL = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
HOSTILE = st.one_of(
    st.sampled_from(["8", "0.5", "true", "", "null", "\ud800", "\u202e\u0000", "9" * 400]),
    st.sampled_from([2**70, -(2**70), 2**64, -(2**63) - 1, 1e308, -1e308, 0, -1, True, None]),
    st.sampled_from([[], {}, [[[[]]]], {"a": {"b": {"c": None}}}, [None] * 50]),
    st.integers(1, 3_000).map(lambda depth: json.loads("[" * min(depth, 900) + "]" * min(depth, 900))),
    st.text(max_size=30), st.floats(allow_nan=False), st.lists(TEXT, max_size=40),
)


# -- strategies from the msgspec types ----------------------------------------------------------------

def from_type(t: mi.Type, name: str = "") -> st.SearchStrategy[Any]:
    """A valid-looking JSON value for one msgspec type (bounds kept, sizes small)."""
    if isinstance(t, mi.StructType):
        # an output length is always given (a missing one would let a case generate a whole context)
        required = {f.encode_name: from_type(f.type, f.name) for f in t.fields if f.required or f.name in SMALL}
        optional = {f.encode_name: from_type(f.type, f.name) for f in t.fields
                    if not (f.required or f.name in SMALL)}
        # a few optional fields at a time: with all of them, nearly every body trips some cross-field check
        chosen = st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True) if optional else st.just([])
        extra = chosen.flatmap(lambda names: st.fixed_dictionaries({n: optional[n] for n in names}))
        return st.builds(lambda a, b: {**a, **b}, st.fixed_dictionaries(required), extra)
    if isinstance(t, mi.UnionType):
        options = [u for u in t.types if not isinstance(u, mi.NoneType)] if name in SMALL else t.types
        return st.one_of([from_type(u, name) for u in options])
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
        high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
        return st.integers(max(low, 1), 8) if name in SMALL else st.integers(low, high)
    if isinstance(t, mi.FloatType):
        low = t.ge if t.ge is not None else t.gt
        high = t.le if t.le is not None else t.lt
        return st.floats(low, high, exclude_min=t.gt is not None, exclude_max=t.lt is not None,
                         allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        return st.just(NAME) if name == "model" else TEXT.filter(lambda text: len(text) >= (t.min_length or 0))
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        item = getattr(t, "item_type", None) or mi.AnyType()
        return st.lists(from_type(item, name), min_size=getattr(t, "min_length", None) or 0, max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(TEXT if isinstance(t.key_type, mi.StrType) else st.just("1"),
                               from_type(t.value_type), max_size=3)
    if isinstance(t, mi.NoneType):
        return st.none()
    return st.one_of(st.none(), st.booleans(), st.integers(-5, 5), TEXT)  # Any and the rest


def mutated(valid: st.SearchStrategy[dict[str, Any]], body_type: type) -> st.SearchStrategy[Any]:
    """A valid body with one hostile change (or something that is not a body at all)."""
    fields = list(body_type.__struct_fields__) + list(getattr(body_type, "unsupported_fields", {}))

    def swap(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
        return {**body, field: value}

    def drop(body: dict[str, Any], field: str) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k != field}

    return st.one_of(
        st.builds(swap, valid, st.sampled_from(fields), HOSTILE),
        st.builds(drop, valid, st.sampled_from([f for f in fields if f not in SMALL])),
        st.builds(swap, valid, TEXT.filter(lambda k: k not in fields), HOSTILE),
        HOSTILE,
    )


def bodies(route: str) -> st.SearchStrategy[Any]:
    """Valid bodies, and mutated ones, about half and half. Half the valid ones carry a well-formed conversation or
    prompt (CONVERSATION) over the drawn one, so that the fuzzer reaches generation whatever the shapes drawn for
    the nested messages are refused for."""
    body_type = ROUTES[route]
    drawn = from_type(mi.type_info(body_type))
    valid = st.one_of(drawn, drawn.map(lambda body: {**body, **CONVERSATION[route]}))
    return st.one_of(valid, mutated(valid, body_type))


CONVERSATION = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "The pagoda"}]},
                "/v1/completions": {"prompt": "The pagoda"}, "/v1/responses": {"input": "The pagoda"},
                "/v1/messages": {"messages": [{"role": "user", "content": "The pagoda"}]}}
CASES = st.sampled_from(list(ROUTES)).flatmap(lambda route: st.tuples(st.just(route), bodies(route)))


# -- the server and its bystander ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, NAME, settings=ServeSettings(), refuse_unknown_models=True, **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def greedy_stream(url: str) -> bytes:
    """A greedy stream's text, as the bytes of its concatenated deltas."""
    body = {"model": NAME, "prompt": "The pagoda stood", "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}
    parts = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts).encode()


class Bystander(threading.Thread):
    """Runs the greedy stream again and again until told to stop; keeps every answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answers, self.stop = url, [], threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for _ in range(10_000):
                if self.stop.is_set():
                    return
                self.answers.append(greedy_stream(self.url))
        except BaseException as exc:  # reported by the test
            self.error = exc


# -- the check of one answer ---------------------------------------------------------------------------

def check_answer(route: str, response: httpx.Response, stream: bool) -> None:
    """A 4xx in the route's protocol's shape, or a well-formed 200; never a 5xx."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if route == "/v1/messages":
            assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        else:
            assert isinstance(body["error"]["message"], str) and "type" in body["error"], body
        return
    assert response.status_code == 200
    if not stream:
        body = response.json()
        assert body.get("choices") or body.get("output") is not None or body.get("content") is not None, body
        return
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert events, response.text[:500]
    assert not any("error" in e and (e.get("type") in (None, "error")) for e in events), response.text[-500:]


def test_fuzzed_bodies_get_a_4xx_in_shape_or_an_answer_and_the_bystander_is_untouched(server):
    solo = greedy_stream(server.url)
    bystander = Bystander(server.url)
    bystander.start()
    client = httpx.Client(base_url=server.url, timeout=120)
    statuses: list[int] = []

    @settings(max_examples=FUZZ_CASES, deadline=None, derandomize=FUZZ_CASES < 1000,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=CASES)
    def one_case(case: tuple[str, Any]) -> None:
        route, body = case
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        stream = isinstance(body, dict) and body.get("stream") is True
        response = client.post(route, content=raw, headers={"content-type": "application/json"})
        statuses.append(response.status_code)
        check_answer(route, response, stream)

    try:
        one_case()
    finally:
        bystander.stop.set()
        bystander.join(120)
        client.close()
    assert statuses.count(200) >= len(statuses) // 10, statuses  # the fuzzer reaches generation, not only refusals
    assert bystander.error is None, bystander.error
    assert bystander.answers and all(answer == solo for answer in bystander.answers), len(bystander.answers)
    server.assert_pool_whole()

