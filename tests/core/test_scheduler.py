import pytest

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import ContextLengthExceeded, KVCacheExhausted, QueueFull, Scheduler


def make(num_blocks=8, block_size=4, max_running=4, max_batched_tokens=16, max_model_len=128, prefix_caching=True):
    config = EngineConfig(num_blocks, block_size, max_running, max_batched_tokens, max_model_len, prefix_caching)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def req(rid, prompt_len, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def commit(batch, token=7):
    """Play the runner and the engine: mark chunks computed, append a token where they sample."""
    for chunk in batch.chunks:
        chunk.request.num_computed_tokens = chunk.end
    for chunk in batch.sample_chunks:
        chunk.request.output_token_ids.append(token)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    s = make(num_blocks=16, max_batched_tokens=16)
    r = req("a", 40)
    s.add(r)
    sizes = []
    for _ in range(3):
        batch = s.schedule()
        sizes.append([(c.start, c.num_tokens, c.samples) for c in batch.chunks])
        commit(batch)
        s.audit()
    assert sizes == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    batch = s.schedule()  # now a decode of the sampled token
    assert [(c.start, c.num_tokens, c.samples) for c in batch.chunks] == [(40, 1, True)]


def test_running_first_then_waiting_and_max_running():
    s = make(num_blocks=32, max_running=2, max_batched_tokens=64)
    for rid in "abc":
        s.add(req(rid, 5))
    batch = s.schedule()
    assert [c.request.request_id for c in batch.chunks] == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1
    commit(batch)
    batch = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in batch.chunks] == [("a", 1), ("b", 1)]


def test_budget_shared_between_decodes_and_a_new_prefill():
    s = make(num_blocks=32, max_batched_tokens=10)
    s.add(req("a", 3))
    commit(s.schedule())
    s.add(req("b", 30))
    batch = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in batch.chunks] == [("a", 1), ("b", 9)]
    assert batch.num_batched_tokens == 10


def test_preemption_evicts_the_newest_and_requeues_it_at_the_front():
    s = make(num_blocks=4, block_size=4, max_batched_tokens=64)
    a, b, c = req("a", 7, 10), req("b", 7, 10), req("c", 3, 4)
    s.add(a)
    s.add(b)
    commit(s.schedule())  # prefill 7 each, sample one
    commit(s.schedule())  # decode: 8 computed each, 2 blocks each: the pool is full
    s.add(c)
    s.audit()
    batch = s.schedule()  # a needs a third block for position 8
    assert batch.preempted_ids == ["b"]
    assert [ch.request.request_id for ch in batch.chunks] == ["a"]  # nothing admitted while evicting
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.block_manager.block_table("b") == []
    assert s.num_preemptions == 1 and s.num_recomputed_tokens == 8
    commit(batch)
    s.audit()


def test_resumed_request_recomputes_prompt_and_output():
    s = make(num_blocks=4, block_size=4, max_batched_tokens=64, prefix_caching=False)  # all of it recomputed
    a, b = req("a", 7, 10), req("b", 7, 10)
    s.add(a)
    s.add(b)
    commit(s.schedule(), token=9)  # both prefilled and sampled one token
    commit(s.schedule(), token=9)  # both decode: 8 computed, the pool is full
    commit(s.schedule())  # a needs a third block -> b evicted, a decodes
    assert b.status is RequestStatus.WAITING
    s.remove(a)  # a leaves; b gets blocks back and recomputes 7 prompt + 2 output tokens
    batch = s.schedule()
    (chunk,) = batch.chunks
    assert (chunk.request, chunk.start, chunk.num_tokens, chunk.samples) == (b, 0, 9, True)
    assert chunk.token_ids == list(range(1, 8)) + [9, 9]


def test_admission_refuses_what_can_never_fit_with_numbers():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(KVCacheExhausted, match=r"needs 5 KV blocks of 4 tokens, but the whole pool has 4"):
        s.add(req("a", 10, 8))  # 10 + 8 - 1 = 17 slots
    s.add(req("b", 10, 7))  # 16 slots: exactly the pool
    with pytest.raises(ContextLengthExceeded, match=r"= 65 exceeds the model's context of 64"):
        s.add(req("c", 60, 5))
    assert s.num_waiting == 1


def test_remove_waiting_and_running():
    s = make(num_blocks=8, max_running=1)
    a, b = req("a", 5), req("b", 5)
    s.add(a)
    s.add(b)
    commit(s.schedule())
    s.remove(b)
    s.remove(a)
    assert s.num_running == s.num_waiting == 0 and s.block_manager.num_free_blocks == 8
    s.audit()


# -- prefix caching --------------------------------------------------------------
def req_of(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0))


def shape(batch):
    return [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in batch.chunks]


def test_resumed_request_recomputes_only_what_the_cache_lost():
    s = make(num_blocks=4, block_size=4, max_batched_tokens=64)
    a, b = req_of("a", range(1, 8), 10), req_of("b", range(21, 28), 10)
    s.add(a)
    s.add(b)
    commit(s.schedule(), token=9)
    commit(s.schedule(), token=9)  # 8 computed each: two full blocks each, the pool is full
    commit(s.schedule())  # a takes a third block: b is preempted, and a's new block evicts b's tail
    assert b.status is RequestStatus.WAITING and s.block_manager.num_cached_free_blocks == 1
    s.remove(a)
    batch = s.schedule()
    (chunk,) = batch.chunks  # b's head block survived in the cache: 4 of its 9 tokens are reused
    assert (chunk.request, chunk.start, chunk.num_tokens, chunk.samples) == (b, 4, 5, True)
    assert chunk.token_ids == [25, 26, 27, 9, 9]
    assert b.num_cached_tokens == 0  # usage counts the first admission, not a resume
    commit(batch)
    s.audit()


def test_admission_counts_only_the_uncached_tokens_and_prefill_starts_after_them():
    s = make(num_blocks=16, max_batched_tokens=10)
    a = req_of("a", range(1, 13))
    s.add(a)
    commit(s.schedule())  # a: 10 of 12
    commit(s.schedule())  # a: the last 2, samples; blocks 0-1 were registered at the top of this step
    b = req_of("b", list(range(1, 13)) + list(range(50, 68)))  # a's 12 tokens + 18 of its own
    s.add(b)
    batch = s.schedule()  # a's blocks 0-2 (12 tokens) are computed and registered by now
    assert shape(batch) == [("a", 12, 1, True), ("b", 12, 9, False)]  # b's chunk fits what a's decode left
    assert s.block_manager.block_table("b")[:3] == s.block_manager.block_table("a")[:3]
    assert b.num_cached_tokens == 12
    assert (s.num_prefix_queried_tokens, s.num_prefix_hit_tokens) == (12 + 30, 12)
    commit(batch)
    s.audit()
    assert shape(s.schedule()) == [("a", 13, 1, True), ("b", 21, 9, True)]


def test_a_block_is_shared_only_once_its_kv_is_computed():
    s = make(num_blocks=16, max_batched_tokens=64)
    s.add(req_of("a", range(1, 9)))
    s.add(req_of("b", range(1, 10)))  # the same 8 tokens, arriving in the same step
    batch = s.schedule()
    assert shape(batch) == [("a", 0, 8, True), ("b", 0, 9, True)]  # nothing computed yet: no hit
    commit(batch)
    s.audit()
    c = req_of("c", range(1, 10))
    s.add(c)
    assert shape(s.schedule())[-1] == ("c", 8, 1, True)  # now a's two blocks serve c


def test_kv_block_check_counts_cached_free_hits_against_the_pool():
    s = make(num_blocks=5, block_size=4, max_batched_tokens=64)
    a = req_of("a", range(1, 9))
    s.add(a)
    commit(s.schedule())
    s.remove(a)  # a's two blocks wait cached-free; 3 truly free
    x = req_of("x", range(40, 45))
    s.add(x)
    commit(s.schedule())  # x holds 2 blocks: free = 1 truly + 2 cached-free
    too_big = req_of("b", list(range(1, 9)) + list(range(60, 68)), 1)  # 2 hits + 2 fresh, but only 1 left
    s.add(too_big)
    assert shape(s.schedule()) == [("x", 5, 1, True)]  # b waits; the hits were not counted as free twice
    assert s.num_waiting == 1
    s.remove(too_big)
    fits = req_of("c", list(range(1, 9)) + [60, 61, 62], 1)  # 2 hits + 1 fresh
    s.add(fits)
    batch = s.schedule()
    assert shape(batch)[-1] == ("c", 8, 3, True)
    assert s.block_manager.num_free_blocks == 0
    commit(batch)
    s.audit()


def test_a_whole_prompt_hit_backs_off_to_recompute_its_last_block():
    s = make(num_blocks=16, max_batched_tokens=64)
    a = req_of("a", range(1, 9))
    s.add(a)
    commit(s.schedule())
    commit(s.schedule())  # a's two prompt blocks are computed and registered
    b = req_of("b", range(1, 9))  # exactly a's prompt: both blocks are cached
    s.add(b)
    batch = s.schedule()
    assert shape(batch)[-1] == ("b", 4, 4, True)  # the block of the last token is recomputed, not shared
    table_a, table_b = s.block_manager.block_table("a"), s.block_manager.block_table("b")
    assert table_b[0] == table_a[0] and table_b[1] != table_a[1]
    commit(batch)
    s.audit()
    commit(s.schedule())  # b's recomputed block is a duplicate: it stays private, the cache keeps a's
    s.audit()
    assert s.block_manager._ref_counts[table_b[1]] == 1 and s.block_manager._hash_of[table_b[1]] is None


def test_preempting_a_sharer_frees_nothing_another_request_uses():
    s = make(num_blocks=6, block_size=4, max_batched_tokens=64)
    a = req_of("a", range(1, 9), 12)
    s.add(a)
    commit(s.schedule())  # a: 8 prompt tokens computed, one sampled
    b = req_of("b", list(range(1, 9)) + [70, 71, 72], 8)  # shares a's two blocks
    s.add(b)
    commit(s.schedule())
    shared = s.block_manager.block_table("a")[:2]
    assert s.block_manager.block_table("b")[:2] == shared
    assert [s.block_manager._ref_counts[blk] for blk in shared] == [2, 2]
    preempted = []
    for _ in range(20):  # decode until the 6-block pool runs out and the newest (b) is preempted
        batch = s.schedule()
        preempted += batch.preempted_ids
        commit(batch)
        s.audit()
        if preempted:
            break
    assert preempted == ["b"] and b.status is RequestStatus.WAITING
    assert s.block_manager.block_table("a")[:2] == shared
    assert [s.block_manager._ref_counts[blk] for blk in shared] == [1, 1]  # still a's, not free


def test_aborting_either_sharer_leaves_the_other_its_blocks():
    for leaver in ("a", "b"):
        s = make(num_blocks=16, max_batched_tokens=64)
        a = req_of("a", range(1, 9))
        s.add(a)
        commit(s.schedule())
        b = req_of("b", list(range(1, 9)) + [70])
        s.add(b)
        commit(s.schedule())
        stays = "b" if leaver == "a" else "a"
        table = list(s.block_manager.block_table(stays))
        s.remove(a if leaver == "a" else b)
        assert s.block_manager.block_table(stays) == table
        assert all(s.block_manager._ref_counts[blk] == 1 for blk in table)
        s.audit()
        commit(s.schedule())
        s.audit()


def test_prefix_caching_off_never_shares():
    s = make(num_blocks=16, max_batched_tokens=64, prefix_caching=False)
    a = req_of("a", range(1, 9))
    s.add(a)
    commit(s.schedule())
    commit(s.schedule())
    s.add(req_of("b", range(1, 10)))
    batch = s.schedule()
    assert shape(batch)[-1] == ("b", 0, 9, True)
    assert (s.num_prefix_queried_tokens, s.num_prefix_hit_tokens) == (0, 0)
    commit(batch)
    s.audit()
    assert s.block_manager.num_cached_free_blocks == 0


def test_a_full_waiting_queue_refuses_a_new_request_but_takes_back_a_preempted_one():
    config = EngineConfig(num_blocks=8, block_size=4, max_running=1, max_batched_tokens=16, max_model_len=128,
                          max_waiting=1)
    s = Scheduler(config, BlockManager(8, 4, True))
    s.add(req("a", 4))
    with pytest.raises(QueueFull, match="max 1"):
        s.add(req("b", 4))
    commit(s.schedule())  # a runs: the queue is empty again
    s.add(req("b", 4))
    assert [r.request_id for r in s.waiting] == ["b"]
    s._preempt(s.running[0])  # a preempted request goes back whatever the limit
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    with pytest.raises(ValueError, match="max_waiting"):
        EngineConfig(max_waiting=0)
