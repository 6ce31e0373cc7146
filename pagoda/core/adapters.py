"""The engine's LoRA adapters: which are loaded, what each costs, and who uses them.

Design note. An adapter is loaded by the runner (its weights are the model's business:
pagoda/model/lora.py) and known to the engine by name, through an `AdapterInfo`. A load has two
halves: `prepare_adapter` reads, checks and builds it on any thread (the async engine runs it on a
worker thread, so the streams step on meanwhile), and `install_adapter` serves it, on the engine's
thread, where the name is checked again (another load may have taken it meanwhile).

The engine counts the live requests of each adapter: unloading one that is in use waits for its last
request to end (new requests for it are refused meanwhile), so a request keeps its adapter from
admission to its end. A request that ends only records that its adapter is to go; the engine unloads
it in a phase of its own after the step's requests have ended (`Engine._unload_released`), so the
runner's failure to unload answers that unload's waiters, never fails a request. Waiters are answered
with `settle`: a caller that stopped waiting (a client gone) has nothing to answer.

Cache keys. A request's KV blocks are keyed by its adapter's key (`Request.adapter_key`, in the block
hash's seed: core/block_hash.py), never shared with another adapter or the base. The key of a name's
first load is the name itself, which is what pagoda's router hashes prompts by (core/routing.py). A
name unloaded and loaded again (perhaps from another directory: other weights) gets a new key,
`name#2`, `name#3`, ..., so the blocks its earlier load computed, still in the cache, never serve it.
A key is never given twice (an adapter named "x#2" loaded first keeps "x#2" from a reload of "x"),
which the table ensures by remembering every key it gave.

Everything here runs on the engine's thread but `snapshot` and `resident`, which others read. No torch here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagoda.core.loop_channel import settle


class AdapterError(ValueError):
    """An adapter refused at load; `field` names what is wrong: a field of its adapter_config.json, a tensor of its
    weights, or the request's own (`lora_name`, `lora_path`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (or is being unloaded); `name` is the name asked for."""

    field = "model"

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


def check_adapter_name(name: object, served_names: Collection[str] = ()) -> None:
    """Refuse (AdapterError naming lora_name) an adapter name a request's `model` could not reach: empty, with white
    space around it, or a name the served model answers to (`served_names`: its name and aliases)."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise AdapterError(f"lora_name {name!r}: an adapter's name is a non-empty string without white space around "
                           f"it", "lora_name")
    if name in served_names:
        raise AdapterError(f"lora_name {name!r} is the served model's name; an adapter needs a name of its own",
                           "lora_name")


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine, /v1/models, /health and /metrics know of one loaded adapter."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    nbytes: int  # resident bytes of its weights (on every rank of a tensor-parallel group, rank 0's)
    target_modules: tuple[str, ...] = ()  # the checkpoint's module names it adapts (q_proj, ...)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "bytes": self.nbytes,
                "target_modules": list(self.target_modules)}


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, checked and built by its runner's `prepare_adapter` (on any thread), not served yet: the
    runner's `install_adapter` serves it, on the engine's thread."""

    info: AdapterInfo
    max_rank: int  # the rank limit it was checked against (a tensor-parallel group's other ranks load it under it)
    weights: Any  # the runner's own (pagoda/model/lora.py's LoraAdapter, the fake model's salts)


@dataclass
class AdapterTable:
    """Loaded adapters by name, their cache keys and the live requests of each; unloads that wait for their last
    request."""

    loaded: dict[str, AdapterInfo] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # name -> the cache key of its current load (the design note)
    users: Counter[str] = field(default_factory=Counter)
    unloading: dict[str, list[Future[AdapterInfo]]] = field(default_factory=dict)
    issued: set[str] = field(default_factory=set)  # every cache key ever given: none is given twice
    # name -> (info, being unloaded) of every adapter holding memory: replaced whole, so other threads read it safely
    resident: dict[str, tuple[AdapterInfo, bool]] = field(default_factory=dict)

    def _publish(self) -> None:
        self.resident = {n: (a, n in self.unloading) for n, a in self.loaded.items()}

    @property
    def snapshot(self) -> dict[str, AdapterInfo]:
        """Name -> info of the adapters a request may name now (any thread: read from `resident`)."""
        return {n: a for n, (a, unloading) in self.resident.items() if not unloading}

    def add(self, info: AdapterInfo) -> None:
        """Serve a loaded adapter under a cache key no earlier load had: its name the first time, else name#n."""
        name = info.name
        key = name
        for n in range(2, len(self.issued) + 3):  # bounded: at most len(issued) candidates are taken
            if key not in self.issued:
                break
            key = f"{name}#{n}"
        self.issued.add(key)
        self.keys[name] = key
        self.loaded[name] = info
        self._publish()

    def check(self, name: str) -> None:
        """Raise UnknownAdapter unless a new request may use `name`."""
        if name not in self.loaded or name in self.unloading:
            known = ", ".join(map(repr, sorted(self.snapshot))) or "none"
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {known})", name=name)

    def acquire(self, name: str | None) -> None:
        """One more live request of `name` (checked by `check` when the request was made)."""
        if name is not None:
            self.users[name] += 1

    def release(self, name: str | None) -> str | None:
        """One request of `name` ended; returns the name when it was the last of an adapter being unloaded."""
        if name is None:
            return None
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            if name in self.unloading:
                return name
        return None

    def begin_unload(self, name: str) -> tuple[Future[AdapterInfo], bool]:
        """A future for the unload of `name`, and whether it can happen now (no live request uses it)."""
        if name not in self.loaded:
            known = ", ".join(map(repr, sorted(self.loaded))) or "none"
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {known})", name=name)
        future: Future[AdapterInfo] = Future()
        self.unloading.setdefault(name, []).append(future)
        self._publish()
        return future, self.users[name] == 0

    def remove(self, name: str, failure: BaseException | None = None) -> AdapterInfo:
        """Forget an adapter whose last request has ended; its waiting unloads are answered (with `failure`, the
        runner's error, when its unload failed; a waiter that left is skipped)."""
        info = self.loaded.pop(name)
        del self.keys[name]
        for future in self.unloading.pop(name, []):
            settle(future, info if failure is None else failure, failed=failure is not None)
        self._publish()
        return info

    def pending_unloads(self) -> list[Future[AdapterInfo]]:
        """Every unload still waiting (for the engine's owner to fail when its loop ends)."""
        return [future for futures in self.unloading.values() for future in futures]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())

    def stats(self) -> dict[str, int]:
        return {"lora_adapters_loaded": len(self.loaded), "lora_adapter_bytes": self.nbytes,
                "lora_adapters_in_use": len(self.users)}
