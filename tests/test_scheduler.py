import pytest

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import ContextLengthExceeded, KVCacheExhausted, Scheduler


def make(num_blocks=8, block_size=4, max_running=4, max_batched_tokens=16, max_model_len=128):
    config = EngineConfig(num_blocks, block_size, max_running, max_batched_tokens, max_model_len)
    return Scheduler(config, BlockManager(num_blocks, block_size))


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
    s = make(num_blocks=4, block_size=4, max_batched_tokens=64)
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
