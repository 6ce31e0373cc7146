"""The keys file (`pagoda serve --api-keys-file FILE`): who may call the server, as tenants.

    {"tenants": [{"name": "team-a", "key_sha256": "<hex of sha256(key)>", "weight": 1, "priority": 0,
                  "max_concurrent": 64, "requests_per_minute": 600, "tokens_per_minute": 200000,
                  "adapters": ["support-bot"], "manage_adapters": false}]}

JSON (`.json`) or TOML (`.toml`, an array of tables `[[tenants]]`); only `name` and `key_sha256` are
required. Keys are never stored: only their SHA-256, so the file can be read by more people than the keys.
`adapters` limits a tenant to those LoRA adapters (by the names they are served as; the base model stays
allowed): another adapter does not exist for it (404). Absent: every adapter. `manage_adapters` (false unless
given) lets its key load and unload adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), which changes
what every tenant is served; `--api-key`'s tenant may, as may everyone on a server without keys.

Design note. A file is read whole into a tuple of frozen `Tenant`s or refused whole with a `KeysFileError`
that says where: the parser's line for a syntax error, else the entry's index and the field. An unknown field
is refused too (a misspelt `max_concurent` would otherwise be no limit at all). `--api-key KEY` is the same
thing with one tenant, "default" (`single_key_tenant`).
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.api.auth import key_hash

DEFAULT_TENANT = "default"  # the tenant of `--api-key`, and the one label of a server without keys
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # a metric label value and a log word: no spaces, bounded
_LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")
_FIELDS = {"name", "key_sha256", "weight", "priority", "adapters", "manage_adapters", *_LIMITS}


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and where in it."""


@dataclass(frozen=True)
class Tenant:
    """One caller of the server: its key's hash, its share of the engine and its limits (None = no limit)."""

    name: str
    key_digest: bytes | None  # sha256(key); None = the tenant of a server that needs no key
    weight: float = 1.0  # its share under fair scheduling (Request.weight)
    priority: int = 0  # the priority of its requests that name none (lower runs first)
    max_concurrent: int | None = None  # its requests in flight at once
    requests_per_minute: int | None = None  # its requests admitted in the last 60 seconds
    tokens_per_minute: int | None = None  # prompt + generated tokens in the last 60 seconds
    # The prefix cache's tenant key (Request.tenant): blocks are shared only within one tenant. None = shared.
    cache_key: str | None = None
    # The LoRA adapters it may name as its model (the base model always); None = every adapter.
    adapters: frozenset[str] | None = None
    manage_adapters: bool = False  # may load and unload LoRA adapters (every tenant is served what it changes)

    def may_use(self, adapter: str) -> bool:
        """Whether this tenant may name the LoRA adapter `adapter` (loaded or not)."""
        return self.adapters is None or adapter in self.adapters


def tenant_cache_key(name: str) -> str:
    """A keys-file tenant's prefix-cache key: from its name, so that rotating its key keeps its cache."""
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"pagoda-tenantnm").hexdigest()


def single_key_tenant(api_key: str) -> Tenant:
    """`--api-key KEY` as a tenant, "default", whose prefix-cache key is the key's hash as it always was."""
    return Tenant(DEFAULT_TENANT, hashlib.sha256(api_key.encode()).digest(), cache_key=key_hash(api_key),
                  manage_adapters=True)


def read_keys_file(path: str | Path) -> tuple[Tenant, ...]:
    """The tenants of a keys file; KeysFileError for a file that is missing, malformed or inconsistent."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"keys file {path}: cannot read it: {exc}") from None
    return parse_keys(text, path.suffix.lower(), str(path))


def parse_keys(text: str, suffix: str, where: str = "keys file") -> tuple[Tenant, ...]:
    """Parse a keys file's text (`suffix`: ".json" or ".toml")."""
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KeysFileError(f"{where}: line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}") from None
    elif suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
            raise KeysFileError(f"{where}: invalid TOML: {exc}") from None
    else:
        raise KeysFileError(f"{where}: a keys file is .json or .toml, got {suffix or 'no suffix'!r}")
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], list):
        raise KeysFileError(f'{where}: the file must hold exactly one field, "tenants", a list of tenants')
    tenants = tuple(_tenant(entry, f"{where}: tenants[{i}]") for i, entry in enumerate(data["tenants"]))
    _check_unique(tenants, where)
    return tenants


def _tenant(entry: Any, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: a tenant is an object with name and key_sha256, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise KeysFileError(f"{where}.{unknown[0]}: unknown field (known: {', '.join(sorted(_FIELDS))})")
    for required in ("name", "key_sha256"):
        if required not in entry:
            raise KeysFileError(f"{where}.{required}: missing (name and key_sha256 are required)")
    name, digest = entry["name"], entry["key_sha256"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeysFileError(f"{where}.name: 1-64 letters, digits and _.:- (starting with a letter or digit),"
                            f" got {name!r}")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
        raise KeysFileError(f"{where}.key_sha256: the key's SHA-256 as 64 hex digits (never the key itself)")
    weight = entry.get("weight", 1.0)
    if not _is_number(weight) or not 0 < weight < float("inf"):
        raise KeysFileError(f"{where}.weight: a number > 0, got {weight!r}")
    priority = entry.get("priority", 0)
    if not _is_int(priority):
        raise KeysFileError(f"{where}.priority: an integer, got {priority!r}")
    limits = {}
    for field in _LIMITS:
        value = entry.get(field)
        if value is not None and (not _is_int(value) or value < 1):
            raise KeysFileError(f"{where}.{field}: a positive integer (or absent: no limit), got {value!r}")
        limits[field] = value
    manage = entry.get("manage_adapters", False)
    if not isinstance(manage, bool):
        raise KeysFileError(f"{where}.manage_adapters: true or false, got {manage!r}")
    return Tenant(name, bytes.fromhex(digest), float(weight), priority, cache_key=tenant_cache_key(name),
                  adapters=_adapters(entry.get("adapters"), where), manage_adapters=manage, **limits)


def _adapters(value: Any, where: str) -> frozenset[str] | None:
    """A tenant's `adapters`: a list of adapter names (possibly empty: the base model only), or absent."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise KeysFileError(f"{where}.adapters: a list of LoRA adapter names (non-empty strings), got {value!r}")
    return frozenset(value)


def _check_unique(tenants: tuple[Tenant, ...], where: str) -> None:
    names: dict[str, int] = {}
    digests: dict[bytes | None, int] = {}
    for i, t in enumerate(tenants):
        if t.name in names:
            raise KeysFileError(f"{where}: tenants[{i}].name: {t.name!r} is also tenants[{names[t.name]}]'s")
        if t.key_digest in digests:
            raise KeysFileError(f"{where}: tenants[{i}].key_sha256: the same key as tenants[{digests[t.key_digest]}]")
        names[t.name], digests[t.key_digest] = i, i


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
