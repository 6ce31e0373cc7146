"""What a router is told: its replicas, its policy and its bounds, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pagoda.core.routing import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD, check_router_policy


@dataclass(frozen=True)
class RouterSettings:
    """`pagoda router`'s options (pagoda/cli/router.py builds them from the command line)."""

    replicas: tuple[str, ...]  # base URLs, e.g. "http://10.0.0.2:8000"; a replica's index is its place here
    policy: str = "prefix"  # one of core.routing.POLICIES
    model_dir: str | None = None  # the replicas' model directory: prefix reads prompts with its tokenizer (no weights)
    tool_parser: str | None = "hermes"  # the replicas' --tool-parser, to render a prompt with tools as they do
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD  # prefix: imbalanced when max - min in flight exceeds this
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD  # ... and max exceeds this times min
    cache_threshold: float = CACHE_THRESHOLD  # prefix: the least share of a prompt's blocks matched worth following
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # checked here as pagoda checks it, and forwarded with the request
    api_keys_file: str | None = None  # the replicas' --api-keys-file: keys checked here, tenants keyed as theirs are
    max_queue_per_replica: int = 64  # requests in flight through this router per replica; beyond on all: 429
    health_interval: float = 0.5  # seconds between two polls of each replica's /health
    health_timeout: float = 2.0  # a /health that takes longer counts as unreachable
    connect_timeout: float = 5.0  # opening a connection to a replica
    seed: int = 0  # power_of_two's RNG
    max_body_bytes: int = 8 * 1024 * 1024  # a bigger request body is refused with 413 (as pagoda serve's default)
    shutdown_timeout: float = 5.0  # on exit, how long requests in flight may run on before they are cut
    log_level: str = "info"

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(url.rstrip("/") for url in self.replicas))  # one spelling each
        if not self.replicas:
            raise ValueError("a router needs at least one --replica URL")
        for url in self.replicas:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"replica {url!r} is not an http(s) URL such as http://127.0.0.1:8000")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"a replica is named twice: {', '.join(self.replicas)}")
        check_router_policy(self.policy)
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance thresholds must be abs >= 0 and rel >= 1, got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")
        if self.max_queue_per_replica < 1:
            raise ValueError(f"max_queue_per_replica must be >= 1, got {self.max_queue_per_replica}")
        for name in ("health_interval", "health_timeout", "connect_timeout", "shutdown_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
