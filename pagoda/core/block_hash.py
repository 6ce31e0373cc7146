"""The chained hash that names a full KV block by everything before it.

Block `i` of a request holds tokens [i * block_size, (i + 1) * block_size).
Its hash covers the parent block's hash and its own token ids, so equal
hashes mean equal prefixes, not just equal blocks. The chain starts from a
seed made of the request's extra keys (a per-request `cache_salt`, the
tenant identity the server sets, and the key of the LoRA adapter its rows add):
requests with different keys never share a block, so one tenant cannot learn
from timing what another sent, and one adapter's KV never serves another's rows.
The adapter's key (`Request.adapter_key`) is its name for the first load of
that name, and a new key for each later load of it (core/adapters.py): a name
unloaded and loaded again from other weights never reads the KV its earlier
load left in the cache. A router that hashes a prompt by the adapter's name
(core/routing.py) thus matches a replica's cache for an adapter loaded once.

The hash is a 128-bit BLAKE2b digest: stable across processes (unlike
Python's `hash` of a string) and collision-resistant. The block manager still
verifies every hit against the parent hash and tokens it stored, so even a
collision never shares a block. No torch here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.core.request import Request

_DIGEST_BYTES = 16


@lru_cache(maxsize=4096)
def chain_seed(cache_salt: str | None, tenant: str | None, adapter: str | None = None) -> int:
    """The parent hash of a request's first block, made of its extra keys (`adapter`: the LoRA adapter's cache key;
    its KV is its own)."""
    keys = ("pagoda-prefix", cache_salt, tenant) if adapter is None else ("pagoda-prefix", cache_salt, tenant, adapter)
    h = hashlib.blake2b(repr(keys).encode(), digest_size=_DIGEST_BYTES)
    return int.from_bytes(h.digest(), "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block: its parent's hash and its token ids."""
    h = hashlib.blake2b(parent_hash.to_bytes(_DIGEST_BYTES, "little"), digest_size=_DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def parent_hash(request: Request, index: int) -> int:
    """The hash block `index` of the request chains from: the previous block's, or the seed."""
    if index == 0:
        return chain_seed(request.cache_salt, request.tenant, request.adapter_key)
    return request.block_hashes[index - 1]


def block_hashes(request: Request, block_size: int, num_blocks: int) -> list[int]:
    """The request's hashes of its first `num_blocks` full blocks (fewer if its tokens end sooner).

    Kept on the request (`request.block_hashes`) and extended only: tokens are
    appended, never changed, so a block's hash never needs recomputing.
    """
    hashes = request.block_hashes
    num_blocks = min(num_blocks, request.num_tokens // block_size)
    for i in range(len(hashes), num_blocks):
        tokens = request.token_ids_slice(i * block_size, (i + 1) * block_size)
        hashes.append(hash_block(parent_hash(request, i), tokens))
    return hashes[:num_blocks] if len(hashes) > num_blocks else hashes
