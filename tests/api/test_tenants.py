"""The keys file, matching a key to its tenant, reloading, a tenant's limits and the `priority` body field."""

from __future__ import annotations

import hashlib
import json
import logging
from types import SimpleNamespace

import pytest

from pagoda.api.auth import key_hash
from pagoda.api.body import decode_body
from pagoda.api.keys_file import KeysFileError, Tenant, parse_keys, read_keys_file, single_key_tenant
from pagoda.api.metrics import Metrics
from pagoda.api.tenant_limits import Refusal, TenantLimits, Ticket, Window
from pagoda.api.tenants import OPEN, TENANT_KEY, TenantTable
from pagoda.plugins.builtin.anthropic_messages import MessagesRequest
from pagoda.plugins.builtin.openai_chat import ChatRequest
from pagoda.plugins.builtin.openai_completions import CompletionRequest
from pagoda.plugins.builtin.openai_responses import ResponsesRequest
from pagoda.plugins.request_fields import RequestError
from tests.helpers import run


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_json(*entries: dict) -> str:
    return json.dumps({"tenants": list(entries)}, indent=2)


def conn(**headers: str) -> SimpleNamespace:
    return SimpleNamespace(headers=headers, scope={})


# -- the keys file -------------------------------------------------------------------------------------
def test_a_json_file_gives_its_tenants_with_defaults():
    a, b = parse_keys(keys_json(
        {"name": "team-a", "key_sha256": sha("ka"), "weight": 2, "priority": -1, "max_concurrent": 4,
         "requests_per_minute": 60, "tokens_per_minute": 1000},
        {"name": "team-b", "key_sha256": sha("kb").upper()}), ".json")
    assert (a.name, a.weight, a.priority, a.max_concurrent, a.requests_per_minute, a.tokens_per_minute) == (
        "team-a", 2.0, -1, 4, 60, 1000)
    assert a.key_digest == hashlib.sha256(b"ka").digest() and b.key_digest == hashlib.sha256(b"kb").digest()
    assert (b.weight, b.priority, b.max_concurrent, b.requests_per_minute, b.tokens_per_minute) == (1.0, 0, None,
                                                                                                    None, None)
    assert a.cache_key != b.cache_key and "team-a" not in a.cache_key


def test_a_toml_file_reads_the_same(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(f'[[tenants]]\nname = "team-a"\nkey_sha256 = "{sha("ka")}"\nmax_concurrent = 2\n')
    (tenant,) = read_keys_file(path)
    assert tenant.name == "team-a" and tenant.max_concurrent == 2


@pytest.mark.parametrize("text, suffix, says", [
    ('{"tenants": [\n  {"name": "a",\n   "key_sha256": }\n]}', ".json", "line 3"),
    ('[[tenants]]\nname = "a"\nkey_sha256 = \n', ".toml", "line 3"),
    ('{"tenants": [{"name": "a"}]}', ".json", "tenants[0].key_sha256: missing"),
    (keys_json({"name": "a", "key_sha256": "ka"}), ".json", "tenants[0].key_sha256: the key's SHA-256"),
    (keys_json({"name": "a", "key_sha256": sha("a")}, {"name": "b", "key_sha256": sha("b"), "weight": 0}), ".json",
     "tenants[1].weight"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "max_concurent": 3}), ".json",
     "tenants[0].max_concurent: unknown"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "requests_per_minute": 1.5}), ".json",
     "tenants[0].requests_per_minute"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "priority": True}), ".json", "tenants[0].priority"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "manage_adapters": "yes"}), ".json",
     "tenants[0].manage_adapters: true or false"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "manage_adapters": 1}), ".json", "tenants[0].manage_adapters"),
    (keys_json({"name": "a", "key_sha256": sha("a"), "manage_adapters": None}), ".json",
     "tenants[0].manage_adapters"),
    (keys_json({"name": "a b", "key_sha256": sha("a")}), ".json", "tenants[0].name"),
    (keys_json({"name": "a", "key_sha256": sha("a")}, {"name": "a", "key_sha256": sha("b")}), ".json",
     "tenants[1].name: 'a' is also tenants[0]'s"),
    (keys_json({"name": "a", "key_sha256": sha("a")}, {"name": "b", "key_sha256": sha("a")}), ".json",
     "tenants[1].key_sha256: the same key as tenants[0]"),
    ('{"tenant": []}', ".json", '"tenants"'),
    ("tenants = []", ".yaml", ".json or .toml"),
])
def test_a_malformed_file_is_refused_naming_where(text, suffix, says):
    with pytest.raises(KeysFileError) as info:
        parse_keys(text, suffix, "keys.x")
    assert says in str(info.value) and str(info.value).startswith("keys.x")


def test_only_a_tenant_marked_so_may_manage_adapters_besides_the_single_key_and_a_server_without_keys(tmp_path):
    """Loading or unloading a LoRA adapter changes what every tenant is served: false unless the file says true."""
    plain, manager = parse_keys(keys_json({"name": "a", "key_sha256": sha("a")},
                                          {"name": "b", "key_sha256": sha("b"), "manage_adapters": True}), ".json")
    assert (plain.manage_adapters, manager.manage_adapters) == (False, True)
    path = tmp_path / "keys.toml"
    path.write_text(f'[[tenants]]\nname = "a"\nkey_sha256 = "{sha("a")}"\nmanage_adapters = true\n')
    assert read_keys_file(path)[0].manage_adapters is True
    assert single_key_tenant("sekret").manage_adapters and OPEN.manage_adapters


def test_a_missing_file_is_a_keys_file_error(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        read_keys_file(tmp_path / "absent.json")


# -- matching --------------------------------------------------------------------------------------------
def test_each_key_names_its_tenant_with_either_header(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(keys_json({"name": "team-a", "key_sha256": sha("ka")}, {"name": "team-b", "key_sha256": sha("kb")}))
    table = TenantTable(keys_file=path)
    assert table.match(["ka"]).name == "team-a" and table.match(["kb"]).name == "team-b"
    assert table.match(["nope", "kb"]).name == "team-b" and table.match(["nope"]) is None and table.match([]) is None
    for connection in (conn(authorization="Bearer ka"), conn(**{"x-api-key": "ka"})):
        table.guard(connection, None)
        assert connection.scope[TENANT_KEY].name == "team-a" and table.of(connection).name == "team-a"
    from litestar.exceptions import NotAuthorizedException
    with pytest.raises(NotAuthorizedException):
        table.guard(conn(authorization="Bearer ka-but-not-quite"), None)


def test_the_single_key_is_tenant_default_with_its_old_cache_key():
    table = TenantTable(api_key="sekret")
    tenant = table.match(["sekret"])
    assert tenant == single_key_tenant("sekret") and tenant.name == "default"
    assert tenant.cache_key == key_hash("sekret")  # the prefix-cache tenant it always had
    assert TenantTable().needs_key is False and TenantTable().of(conn()) is OPEN and OPEN.cache_key is None


def test_the_single_key_and_a_file_combine(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(keys_json({"name": "team-a", "key_sha256": sha("ka")}))
    table = TenantTable(api_key="sekret", keys_file=path)
    assert [t.name for t in table.tenants] == ["default", "team-a"]
    path.write_text(keys_json({"name": "default", "key_sha256": sha("ka")}))
    with pytest.raises(KeysFileError, match="--api-key"):
        TenantTable(api_key="sekret", keys_file=path)


def test_a_reload_adds_a_key_and_a_bad_one_keeps_the_old_keys(tmp_path, caplog):
    path = tmp_path / "keys.json"
    path.write_text(keys_json({"name": "team-a", "key_sha256": sha("ka")}))
    table = TenantTable(keys_file=path)
    assert table.match(["kb"]) is None
    path.write_text(keys_json({"name": "team-a", "key_sha256": sha("ka")}, {"name": "team-b", "key_sha256": sha("kb")}))
    assert table.reload() is True and table.match(["kb"]).name == "team-b"
    path.write_text('{"tenants": [{"name": "team-c"}]}')
    with caplog.at_level(logging.ERROR, logger="pagoda.api"):
        assert table.reload() is False
    assert "tenants[0].key_sha256: missing" in caplog.text and "previous keys stay" in caplog.text
    assert table.match(["ka"]).name == "team-a" and table.match(["kb"]).name == "team-b"


# -- limits ------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_slides_out_in_one_second_buckets():
    w = Window()
    w.add(10.2, 3)
    w.add(10.7, 2)
    w.add(30.0, 5)
    assert w.total(30.0) == 10 and w.seconds_until_below(10, 30.0) == pytest.approx(40.0)
    assert w.seconds_until_below(6, 30.0) == pytest.approx(40.0) and w.seconds_until_below(11, 30.0) == 0.0
    assert w.seconds_until_below(5, 30.0) == pytest.approx(60.0)  # the second bucket must go too
    assert w.total(70.0) == 5 and w.total(90.0) == 0


def test_max_concurrent_refuses_until_a_ticket_is_released_and_leaves_others_alone():
    limits = TenantLimits(Metrics(), Clock())
    a, b = Tenant("a", b"x", max_concurrent=2), Tenant("b", b"y", max_concurrent=1)
    tickets = [limits.admit(a, 5), limits.admit(a, 5)]
    assert all(isinstance(t, Ticket) for t in tickets)
    refusal = limits.admit(a, 5)
    assert isinstance(refusal, Refusal) and refusal.reason == "max_concurrent" and refusal.retry_after == 1
    assert isinstance(limits.admit(b, 5), Ticket)  # another tenant is untouched
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert isinstance(limits.admit(a, 5), Ticket)
    assert limits.states["a"].in_flight == 2


def test_requests_per_minute_says_when_to_come_back():
    clock = Clock()
    limits = TenantLimits(Metrics(), clock)
    a = Tenant("a", b"x", requests_per_minute=2)
    for _ in range(2):
        limits.admit(a, 1).release()
        clock.now += 10
    refusal = limits.admit(a, 1)
    assert refusal.reason == "requests_per_minute" and refusal.retry_after == 40  # the first slides out at 1060
    clock.now += 40
    assert isinstance(limits.admit(a, 1), Ticket)


def test_tokens_per_minute_counts_prompt_at_admission_and_output_as_it_comes():
    clock = Clock()
    metrics = Metrics()
    limits = TenantLimits(metrics, clock)
    a = Tenant("a", b"x", tokens_per_minute=100)
    ticket = limits.admit(a, 60)

    async def outputs():
        for n in (30, 20):
            yield SimpleNamespace(new_token_ids=[1] * n)

    async def consume():
        return [o async for o in ticket.count(outputs())]

    assert len(run(consume())) == 2
    ticket.release()
    assert limits.states["a"].tokens.total(clock.now) == 110
    refusal = limits.admit(a, 1)
    assert refusal.reason == "tokens_per_minute" and refusal.retry_after == 60
    assert metrics.tenant_tokens.labels(tenant="a", kind="completion")._value.get() == 50
    assert metrics.tenant_rejected.labels(tenant="a", reason="tokens_per_minute")._value.get() == 1
    clock.now += 60
    assert isinstance(limits.admit(a, 1), Ticket)


# -- the priority body field -----------------------------------------------------------------------------------
BODIES = {ChatRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
          CompletionRequest: {"model": "m", "prompt": "hi"},
          ResponsesRequest: {"model": "m", "input": "hi"},
          MessagesRequest: {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("body_type", list(BODIES))
def test_priority_is_an_integer_on_all_four_protocols(body_type):
    assert decode_body(body_type, json.dumps({**BODIES[body_type], "priority": -3}).encode()).priority == -3
    assert decode_body(body_type, json.dumps(BODIES[body_type]).encode()).priority is None
    for bad in ("high", 1.5, True, 2**40):
        with pytest.raises(RequestError) as info:
            decode_body(body_type, json.dumps({**BODIES[body_type], "priority": bad}).encode())
        assert info.value.param == "priority" and info.value.status == 400
