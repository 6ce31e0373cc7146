"""What a prefix-aware router reads of a request: its rendered prompt tokens and the keys its cached blocks
are shared under, read exactly as a replica reads them.

Design note. The prefix cache keys on token blocks, not text, so the router renders a request as a replica
does: the body is decoded strictly (pagoda.api.body) into the endpoint's own struct, and the endpoint's
`prepare` (the same plugin code the replica runs) renders the chat template and tokenizes, with the model's
tokenizer loaded here (no weights). The keys are the body's `cache_salt`, the prefix-cache key of the
tenant the proxy's guard matched the presented key to, in a table read from the same `--api-key` /
`--api-keys-file` the replicas have (pagoda.api.tenants.TenantTable, as a replica matches it), and the LoRA
adapter the body's `model` names: a replica runs a request on the adapter its `model` names, and keys the
adapter's KV apart, so the router keys the prompt under that adapter when a replica's /health lists it
(`lora_adapters`; router/replicas.py, `adapter_names`), and under the base model otherwise, as the replica
does for its own name. A body the replica will refuse, a path that is
not a generation endpoint, or any failure to render gives no prompt: the policy then balances by load alone,
and the replica answers the request as it would have anyway. For a request with several prompts (a
completions batch, `n` > 1) the first prompt decides.

Reading runs in a worker thread (the proxy's `asyncio.to_thread`), not on the event loop that relays every
other stream: a prompt of 4,000 tokens takes about 40 ms to render and tokenize on one core of the machine in
docs/distributed.md, which on the loop would stall every stream the router relays for that long. Tokenizing,
about 95% of it, releases the GIL, so prompts are also read side by side on several cores. A reader keeps no
state between calls (the tokenizer is safe to share between threads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.types import Scope

from pagoda.api.body import decode_body
from pagoda.api.tenants import TenantTable
from pagoda.core.routing import RouteRequest
from pagoda.core.tokenizer import Tokenizer
from pagoda.plugins.protocol import Endpoint, EngineRequest, ServeContext
from pagoda.plugins.tools import ToolParser

logger = logging.getLogger("pagoda.router")

UNBOUNDED = 1 << 40  # the router enforces no context or pool limit: the replica does, with its own numbers


class PromptReader:
    """Reads `RouteRequest`s from request bodies with one model's tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, tenants: TenantTable | None = None,
                 tool_parser: ToolParser | None = None,
                 adapters: Callable[[], Collection[str]] = frozenset) -> None:
        self.context = ServeContext(tokenizer=tokenizer, model_name="", max_model_len=UNBOUNDED,
                                    max_kv_tokens=UNBOUNDED, tool_parser=tool_parser)
        self.tenants = tenants if tenants is not None else TenantTable()  # no keys: one tenant, a shared cache
        self.adapters = adapters  # the LoRA adapters the replicas serve now, by name (Fleet.adapter_names)

    def read(self, endpoint: Endpoint | None, body: bytes, scope: Scope) -> RouteRequest | None:
        """The request's first prompt and its cache keys; None when the router cannot tell them."""
        if endpoint is None:
            return None
        try:
            headers = dict(scope.get("headers") or [])
            content_type = headers.get(b"content-type", b"application/json").decode("latin-1")
            decoded = decode_body(endpoint.body_type, body, content_type)
            prepared: Any = endpoint.prepare(decoded, self.context)
            first: EngineRequest = prepared if isinstance(prepared, EngineRequest) else prepared[0]
            tenant = self.tenants.of(ASGIConnection(scope))  # the one the proxy's guard matched (OPEN: no keys)
        except Exception as exc:  # the replica will answer it (most often its 4xx): routing by load is enough
            logger.debug("no prompt read for %s: %s: %s", endpoint.path, type(exc).__name__, exc)
            return None
        return RouteRequest(first.prompt_token_ids, first.cache_salt, tenant.cache_key,
                            self.adapter_of(getattr(decoded, "model", None)))

    def adapter_of(self, model: Any) -> str | None:
        """The adapter a replica runs a request asking for `model` on (adapter_named)."""
        return adapter_named(model, self.adapters())


def adapter_named(model: Any, adapters: Collection[str]) -> str | None:
    """The adapter a replica runs a request asking for `model` on: that name when the replicas serve an adapter by
    it; None (the base model) for any other name, or none."""
    return model if isinstance(model, str) and model in adapters else None


class _Model(msgspec.Struct):
    model: Any = None  # every other field of the body is skipped unread


def body_adapter(body: bytes, adapters: Collection[str]) -> str | None:
    """The adapter a generation request's body names as its `model` (adapter_named), read without rendering the
    prompt, for a policy that reads none; None for a body that is not such a JSON object (the replica answers it)."""
    if not adapters:
        return None
    try:
        return adapter_named(msgspec.json.decode(body, type=_Model).model, adapters)
    except (msgspec.DecodeError, RecursionError):
        return None
