"""TorchModelRunner: scheduler batches in, the right logits out, KV where the block tables say."""

from __future__ import annotations

import torch

from pagoda.core.batch import ScheduledChunk, SchedulerOutput
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import named_config
from pagoda.model.llama import build_model
from pagoda.model.runner import StepPlan, TorchModelRunner, auto_num_blocks, kv_cache_bytes_per_block

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def make_runner(seed=0, **kw):
    model = build_model(named_config("tiny"), max_positions=256)
    model.init_random_weights(seed=seed, std=0.1)
    return TorchModelRunner(model, EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE), **kw)


def request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def chunk(req, start, num_tokens, blocks):
    need = -(-(start + num_tokens) // BLOCK_SIZE)
    return ScheduledChunk(req, start, num_tokens, tuple(blocks[:need]))


def step(runner, *chunks):
    return runner.execute(SchedulerOutput(list(chunks), BLOCK_SIZE)).logits


def prompt(seed, n):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_shot_prefill_returns_the_last_rows_logits():
    runner = make_runner()
    tokens = prompt(0, 23)
    logits = step(runner, chunk(request("a", tokens), 0, 23, list(range(6))))
    with torch.inference_mode():
        dense = runner.model.reference_forward(torch.tensor(tokens))
    assert logits.shape == (1, runner.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], dense[-1], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot_prefill_bit_for_bit():
    tokens = prompt(1, 30)
    blocks = [9, 2, 17, 4, 30, 11, 6, 21]
    one_shot = step(make_runner(), chunk(request("a", tokens), 0, 30, blocks))
    runner = make_runner()
    req = request("a", tokens)
    pieces = [(0, 7), (7, 1), (8, 13), (21, 9)]  # uneven chunks crossing block boundaries
    for start, n in pieces[:-1]:
        out = step(runner, chunk(req, start, n, blocks))
        assert out.shape == (0, runner.vocab_size)  # a chunk short of the end samples nothing
        req.num_computed_tokens = start + n
    chunked = step(runner, chunk(req, *pieces[-1], blocks))
    assert torch.equal(chunked, one_shot)


def test_mixed_batch_gives_each_request_its_solo_logits():
    # A decode, a middle prefill chunk (no sample) and a full prompt in one step,
    # against each run alone; sample rows come back in sample_chunks order.
    specs = {"a": (prompt(2, 9), [0, 1, 2]), "b": (prompt(3, 14), [3, 4, 5, 6]), "c": (prompt(4, 5), [7, 8])}
    solo = {}
    for rid, (tokens, blocks) in specs.items():
        runner = make_runner()
        solo[rid] = step(runner, chunk(request(rid, tokens), 0, len(tokens), blocks))[0]
    runner = make_runner()
    a, b, c = (request(rid, specs[rid][0]) for rid in "abc")
    step(runner, chunk(a, 0, 8, specs["a"][1]))  # a: all but its last token cached
    a.num_computed_tokens = 8
    batch = [chunk(a, 8, 1, specs["a"][1]), chunk(b, 0, 10, specs["b"][1]), chunk(c, 0, 5, specs["c"][1])]
    logits = step(runner, *batch)
    assert [ch.request.request_id for ch in SchedulerOutput(batch, BLOCK_SIZE).sample_chunks] == ["a", "c"]
    assert torch.equal(logits[0], solo["a"]) and torch.equal(logits[1], solo["c"])
    b.num_computed_tokens = 10
    assert torch.equal(step(runner, chunk(b, 10, 4, specs["b"][1]))[0], solo["b"])


def test_kv_goes_only_to_the_scheduled_slots():
    runner = make_runner()
    step(runner, chunk(request("a", prompt(5, 6)), 0, 6, [5, 40]))  # 6 tokens + 2 padding rows
    k_cache, v_cache = runner.kv_caches[0]
    written = (k_cache.abs().sum(dim=(2, 3)) != 0).nonzero().tolist()  # [block, offset] pairs
    assert written == [[5, 0], [5, 1], [5, 2], [5, 3], [40, 0], [40, 1]]
    assert (v_cache.abs().sum(dim=(2, 3)) != 0).sum() == 6


def test_runner_pads_rows_to_the_kernels_row_multiple():
    assert make_runner().row_multiple == make_runner().model.matmul.row_multiple > 1  # CPU float32
    runner = make_runner(row_multiple=4)
    batch = SchedulerOutput([chunk(request("a", prompt(6, 5)), 0, 5, [0, 1]), chunk(request("b", [7]), 0, 1, [2])], BLOCK_SIZE)
    inputs = runner.prepare(StepPlan.of(batch))
    assert inputs.input_ids.shape == (8,) and inputs.ctx.num_tokens == 6
    assert inputs.positions[:6].tolist() == [0, 1, 2, 3, 4, 0]
    assert inputs.ctx.meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8]
    assert inputs.sample_rows.tolist() == [4, 5, 0, 0] and inputs.num_samples == 2


def test_auto_num_blocks_sizes_from_memory_with_a_floor():
    config = named_config("smollm2-135m")
    per_block = kv_cache_bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4
    n = auto_num_blocks(config, 16, torch.float32, torch.device("cpu"), cpu_cap_bytes=64 << 20)
    assert n == (64 << 20) // per_block  # capped on the CPU
    assert auto_num_blocks(config, 16, torch.float32, torch.device("cpu"), cpu_cap_bytes=0, max_model_len=8192) == 512


def test_runner_packs_the_weights_for_its_matmul_kernel():
    runner = make_runner()
    packs = runner.model.matmul.pack is not None
    assert (runner.model.lm_head_packed.packed is not None) == packs
    assert (runner.model.model.layers[0].self_attn.qkv_proj.packed.packed is not None) == packs


def test_make_engine_sizes_the_cache_and_the_pool_from_one_config():
    from pagoda.model.factory import make_engine

    model = build_model(named_config("tiny"), max_positions=256)
    model.init_random_weights(seed=0, std=0.1)
    engine = make_engine(model, EngineConfig(num_blocks=12, block_size=8, max_model_len=64))
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.shape[:2] == v_cache.shape[:2] == (12, 8) and engine.block_manager.num_blocks == 12
    engine.add_request("a", prompt(7, 10), SamplingParams(max_tokens=3, temperature=0))
    assert sum(len(o.new_token_ids) for o in engine.run()) == 3
    engine.audit()


class ThreadProbe:
    """The CPU attention backend, noting the thread count each attention call ran on."""

    name = "cpu"

    def __init__(self) -> None:
        from pagoda.kernels.cpu_attention import CpuBackend

        self.inner, self.seen = CpuBackend(), []

    def write_kv(self, *args):
        self.inner.write_kv(*args)

    def attention(self, *args):
        self.seen.append(torch.get_num_threads())
        return self.inner.attention(*args)


def test_a_small_steps_attention_runs_on_one_thread_and_the_rest_on_all():
    probe = ThreadProbe()
    runner = make_runner(backend=probe)
    layers = runner.model_config.num_hidden_layers
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step(runner, chunk(request("a", prompt(1, 8)), 0, 8, list(range(NUM_BLOCKS))))  # 4 heads x 8 x 8 scores
        assert probe.seen == [1] * layers and torch.get_num_threads() == 2  # and the count is back
        probe.seen.clear()
        runner.small_attention = 4 * 8 * 8 - 1  # the same step's attention is now a big one
        step(runner, chunk(request("b", prompt(1, 8)), 0, 8, list(range(NUM_BLOCKS))))
        assert probe.seen == [2] * layers
    finally:
        torch.set_num_threads(threads)


def test_a_small_steps_linear_layers_run_on_every_thread_and_the_rest_on_one():
    from pagoda.model.runner import StepThreads

    seen = []

    class Layer:  # records the threads it runs on
        in_features, out_features = 8, 4

        def __call__(self, x):
            seen.append(torch.get_num_threads())
            return x

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step_threads = StepThreads(narrow=1, full=2)
        with step_threads.step():
            seen.append(torch.get_num_threads())
            step_threads.linear(Layer(), torch.zeros(1, 8))
            seen.append(torch.get_num_threads())
        assert seen == [1, 2, 1] and torch.get_num_threads() == 2
        seen.clear()  # a kernel for which waking a thread costs more than 3 x 8 x 4 multiply-adds save
        step_threads = StepThreads(narrow=1, full=2, min_parallel_work=3 * 8 * 4 + 1)
        with step_threads.step():
            step_threads.linear(Layer(), torch.zeros(3, 8))  # under the kernel's figure: stays on one thread
            step_threads.linear(Layer(), torch.zeros(4, 8))  # over it: every thread
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(threads)
