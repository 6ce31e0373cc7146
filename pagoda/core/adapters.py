"""The engine's LoRA adapters: which are loaded, what each costs, and who uses them.

Design note. An adapter is loaded by the runner (its weights are the model's business:
pagoda/model/lora.py) and known to the engine by name, through an `AdapterInfo`. The engine
counts the live requests of each adapter: unloading one that is in use waits for its last
request to end (new requests for it are refused meanwhile), so a request keeps its adapter
from admission to its end. Everything here runs on the engine's thread but `snapshot`, which
others read. No torch here.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class AdapterError(ValueError):
    """An adapter refused at load; `field` names what is wrong: a field of its adapter_config.json, a tensor of its
    weights, or the request's own (`lora_name`, `lora_path`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (or is being unloaded)."""

    field = "model"


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


@dataclass
class AdapterTable:
    """Loaded adapters by name and the live requests of each; unloads that wait for their last request."""

    loaded: dict[str, AdapterInfo] = field(default_factory=dict)
    users: Counter[str] = field(default_factory=Counter)
    unloading: dict[str, list[Future[AdapterInfo]]] = field(default_factory=dict)
    # name -> info of the adapters a request may name now: replaced whole, so other threads read it safely
    snapshot: dict[str, AdapterInfo] = field(default_factory=dict)

    def _publish(self) -> None:
        self.snapshot = {n: a for n, a in self.loaded.items() if n not in self.unloading}

    def add(self, info: AdapterInfo) -> None:
        self.loaded[info.name] = info
        self._publish()

    def check(self, name: str) -> None:
        """Raise UnknownAdapter unless a new request may use `name`."""
        if name not in self.loaded or name in self.unloading:
            known = ", ".join(map(repr, sorted(self.snapshot))) or "none"
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {known})")

    def acquire(self, name: str | None) -> None:
        if name is not None:
            self.check(name)
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
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        future: Future[AdapterInfo] = Future()
        self.unloading.setdefault(name, []).append(future)
        self._publish()
        return future, self.users[name] == 0

    def remove(self, name: str) -> AdapterInfo:
        """Forget an adapter whose last request has ended; its waiting unloads are answered."""
        info = self.loaded.pop(name)
        for future in self.unloading.pop(name, []):
            future.set_result(info)
        self._publish()
        return info

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())

    def stats(self) -> dict[str, int]:
        return {"lora_adapters_loaded": len(self.loaded), "lora_adapter_bytes": self.nbytes,
                "lora_adapters_in_use": len(self.users)}
