import pytest

from pagoda.core.block_manager import AuditError, BlockManager


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
