import pytest

from pagoda.core import block_hash
from pagoda.core.block_audit import AuditError
from pagoda.core.block_manager import BlockManager
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams


def test_allocate_grow_free_and_counters():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == bm.block_table("a") and len(bm.block_table("a")) == 2
    bm.allocate("a", 8)  # still fits in two blocks
    assert len(bm.block_table("a")) == 2
    bm.allocate("a", 9)
    assert len(bm.block_table("a")) == 3
    bm.allocate("b", 1)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 4)
    bm.audit({"a": 9, "b": 1})
    assert bm.free("a") == 3 and bm.num_free_blocks == 7
    bm.audit({"b": 1})


def test_can_allocate_is_exact_and_allocate_refuses_beyond():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.can_allocate("a", 8) and not bm.can_allocate("a", 9)
    with pytest.raises(RuntimeError, match="needs 3 blocks, 2 free"):
        bm.allocate("a", 9)
    assert bm.num_free_blocks == 2  # a refused allocation takes nothing


def test_free_unknown_is_noop():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.free("nobody") == 0
    bm.audit({})


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: bm._tables["b"].append(bm._tables["a"][0]), "ref count"),
        (lambda bm: bm._free.append(bm._tables["a"][0]), "free and owned"),
        (lambda bm: bm._free.popleft(), "neither free nor owned"),
        (lambda bm: bm._free.append(bm._free[0]), "free list twice"),
        (lambda bm: bm._tables["a"].pop(), "ref count"),
    ],
)
def test_audit_catches_each_corruption(corrupt, message):
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 4)
    bm.allocate("b", 2)
    bm.audit({"a": 4, "b": 2})
    corrupt(bm)
    with pytest.raises(AuditError, match=message):
        bm.audit({"a": 4, "b": 2})


def test_audit_checks_tables_cover_exactly_the_computed_tokens():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 4)
    with pytest.raises(AuditError, match="computed tokens"):
        bm.audit({"a": 2})  # one block too many
    with pytest.raises(AuditError, match="not a live request"):
        bm.audit({})  # blocks held by a request nobody knows


def test_invalid_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


# -- prefix caching --------------------------------------------------------------
def req(rid, tokens, **keys):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), **keys)


def computed(bm, request, num_tokens=None, hits=()):
    """Play scheduler and engine: take the hits, cover the tokens, mark them computed, register full blocks."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    bm.allocate(request.request_id, num_tokens, hits)
    request.num_computed_tokens = num_tokens
    bm.cache_blocks(request)
    return bm.block_table(request.request_id)


def audit(bm, *requests):
    bm.audit({r.request_id: r.num_computed_tokens for r in requests}, {r.request_id: r.all_token_ids for r in requests})


def test_a_computed_prefix_is_found_and_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(1, 11))
    table_a = computed(bm, a)  # 10 tokens: blocks 0 and 1 are full and registered, block 2 is not
    b = req("b", list(range(1, 9)) + [50, 51, 52])
    hits = bm.cached_prefix(b)
    assert hits == table_a[:2]
    table_b = computed(bm, b, hits=hits)
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert [bm._ref_counts[blk] for blk in table_a] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    audit(bm, a, b)


def test_misses_different_tokens_salt_or_tenant():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, req("a", range(1, 10), cache_salt="s", tenant="t1"))
    assert len(bm.cached_prefix(req("same", range(1, 10), cache_salt="s", tenant="t1"))) == 2
    assert bm.cached_prefix(req("other-tenant", range(1, 10), cache_salt="s", tenant="t2")) == []
    assert bm.cached_prefix(req("other-salt", range(1, 10), cache_salt="x", tenant="t1")) == []
    assert bm.cached_prefix(req("no-keys", range(1, 10))) == []
    assert bm.cached_prefix(req("first-differs", [99, *range(2, 10)], cache_salt="s", tenant="t1")) == []
    second = bm.cached_prefix(req("second-differs", [*range(1, 5), 99, *range(6, 10)], cache_salt="s", tenant="t1"))
    assert len(second) == 1  # the chain stops at the first block that differs


def test_only_computed_blocks_are_registered():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(1, 13))
    bm.allocate("a", 12)  # scheduled, not yet computed: being written
    assert bm.cached_prefix(req("b", range(1, 13))) == []
    a.num_computed_tokens = 6
    bm.cache_blocks(a)
    assert len(bm.cached_prefix(req("b", range(1, 13)))) == 1
    a.num_computed_tokens = 12
    bm.cache_blocks(a)
    assert len(bm.cached_prefix(req("b", range(1, 14)))) == 3
    audit(bm, a)


def test_the_block_of_the_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, req("a", range(1, 13)))
    assert len(bm.cached_prefix(req("whole", range(1, 9)))) == 1  # 8 of 8 cached: back off one block
    assert len(bm.cached_prefix(req("one-more", range(1, 10)))) == 2


def test_output_tokens_that_fill_a_block_are_cached_too():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(1, 7))
    computed(bm, a)
    a.output_token_ids += [7, 8, 9]  # the engine sampled three tokens: positions 6 and 7 computed by now
    bm.allocate("a", 8)
    a.num_computed_tokens = 8
    bm.cache_blocks(a)
    assert len(bm.cached_prefix(req("next-turn", [*range(1, 10), 40]))) == 2


def test_freed_blocks_wait_cached_free_and_are_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    x, y = req("x", [1, 2, 3, 4]), req("y", [5, 6, 7, 8])
    table_x = computed(bm, x)
    table_y = computed(bm, y)
    assert bm.free("x") == 2 and bm.free("y") == 2
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 4  # all cached-free, none truly free
    bm.audit({})
    # x's tail was freed first (a table is freed last block first), so it is evicted first
    bm.allocate("z", 1)
    assert bm.block_table("z") == [table_x[1]]
    assert bm.cached_prefix(req("x2", [1, 2, 3, 4, 9])) == [table_x[0]]
    # a hit takes the block back out of the LRU: the next eviction skips it
    bm.allocate("x2", 3, [table_x[0]])
    assert bm.block_table("x2") == [table_x[0], table_y[1]]
    assert bm.cached_prefix(req("y2", [5, 6, 7, 8, 9])) == [table_y[0]]
    bm.audit({"z": 1, "x2": 3})


def test_truly_free_blocks_are_taken_before_any_cached_one_is_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    computed(bm, a)
    bm.free("a")
    bm.allocate("b", 4)
    assert bm.num_cached_free_blocks == 2 and len(bm.cached_prefix(req("a2", [1, 2, 3, 4, 5]))) == 2


def test_verification_rejects_a_forced_hash_collision(monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, tokens: 7)  # every block hashes the same
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(1, 10))
    table_a = computed(bm, a)
    assert bm._cached == {7: table_a[0]}  # one block per hash: a's second block stays private
    assert bm.cached_prefix(req("b", [9, 9, 9, 9, 9])) == []  # same hash, other tokens: a miss
    assert bm.cached_prefix(req("c", [*range(1, 5), 9, 9, 9, 9, 9])) == [table_a[0]]  # tokens verified
    # same hash and tokens, another chain: the stored parent hash (the seed of other keys) differs
    assert bm.cached_prefix(req("d", [*range(1, 5), 9], tenant="t")) == []
    audit(bm, a)


def test_ref_counts_follow_every_sharer():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(1, 6))
    shared = computed(bm, a)[0]
    sharers = [req(rid, [1, 2, 3, 4, n]) for rid, n in (("b", 8), ("c", 9))]
    for r in sharers:
        computed(bm, r, hits=bm.cached_prefix(r))
    assert bm._ref_counts[shared] == 3
    for i, leaving in enumerate([a, *sharers]):
        bm.free(leaving.request_id)
        still = [r for r in [a, *sharers][i + 1 :]]
        assert bm._ref_counts[shared] == len(still)
        assert (shared in bm._cached_free) == (not still)  # free only when the last holder leaves
        audit(bm, *still)


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4])
    computed(bm, a)
    assert bm.cached_prefix(req("b", [1, 2, 3, 4, 5])) == []
    bm.free("a")
    assert bm.num_cached_free_blocks == 0
    bm.audit({})


def shared_pool():
    """a computed 9 tokens (two registered blocks); b shares both and holds one of its own."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req("a", range(1, 10)), req("b", [*range(1, 9), 30])
    computed(bm, a)
    computed(bm, b, hits=bm.cached_prefix(b))
    audit(bm, a, b)
    return bm, a, b


def test_the_audit_catches_a_shared_block_freed_while_in_use():
    """Sabotage: a free that ignores the other holders returns a shared block to the pool."""
    bm, a, b = shared_pool()
    for block_id in bm._tables.pop("a"):
        bm._ref_counts[block_id] = 0
        if bm._hash_of[block_id] is None:
            bm._free.append(block_id)
        else:
            bm._cached_free[block_id] = None
    with pytest.raises(AuditError, match="ref count 0 but 1 holders"):
        audit(bm, b)


def share_a_private_block(bm):
    block_id = bm._tables["a"][2]
    bm._tables["d"].append(block_id)
    bm._ref_counts[block_id] += 1


def register(bm, block_id, parent, tokens):
    """Register a block under a hash consistent with the key it claims."""
    h = block_hash.hash_block(parent, tokens)
    bm._cached[h], bm._hash_of[block_id], bm._key_of[block_id] = block_id, h, (parent, tokens)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (share_a_private_block, "shared by 2 requests but holds no cached prefix"),
        (lambda bm: bm._free.append(bm._cached_free.popitem()[0]), "truly free block .* still carries a hash"),
        (lambda bm: bm._cached_free.__setitem__(bm._free[0], None), "both truly free and cached-free"),
        (lambda bm: bm._hash_of.__setitem__(bm._tables["a"][2], bm._hash_of[bm._tables["a"][0]]), "maps to blocks"),
        (lambda bm: bm._key_of.__setitem__(bm._tables["a"][0], (0, (1, 2, 3, 4))), "does not match the tokens"),
        (lambda bm: bm._cached.pop(bm._hash_of[bm._tables["a"][1]]), "which the cache does not map to it"),
        (lambda bm: register(bm, bm._free[0], 0, (1, 1, 1, 1)), "truly free block .* still carries a hash"),
    ],
)
def test_the_audit_catches_each_cache_corruption(corrupt, message):
    bm, a, b = shared_pool()
    computed(bm, req("c", [40, 41, 42, 43, 44]))
    bm.free("c")  # c's full block waits cached-free
    d = req("d", [50])
    computed(bm, d)
    audit(bm, a, b, d)
    corrupt(bm)
    with pytest.raises(AuditError, match=message):
        audit(bm, a, b, d)


def test_the_audit_catches_a_cached_block_that_is_still_being_written_or_not_the_holders():
    bm, a, b = shared_pool()
    table = bm.block_table("b")
    register(bm, table[2], bm._hash_of[table[1]], (30, 0, 0, 0))  # b's partial last block, registered early
    with pytest.raises(AuditError, match="still writing block"):
        audit(bm, a, b)
    bm, a, b = shared_pool()
    with pytest.raises(AuditError, match="whose tokens are not its own"):
        bm.audit({"a": 9, "b": 9}, {"a": a.all_token_ids, "b": [7] * 9})


def test_the_audit_catches_a_cached_block_that_does_not_chain_or_has_lost_its_key():
    bm, a, b = shared_pool()
    second = bm.block_table("a")[1]
    del bm._cached[bm._hash_of[second]]
    register(bm, second, 12345, tuple(a.all_token_ids[4:8]))  # a's own tokens, under another parent
    with pytest.raises(AuditError, match="does not chain from the block before"):
        audit(bm, a, b)
    bm, a, b = shared_pool()
    bm._key_of[bm.block_table("a")[1]] = None
    with pytest.raises(AuditError, match="does not match the tokens"):
        audit(bm, a, b)
