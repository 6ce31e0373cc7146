"""A request's tokens do not depend on what else runs: alone, in a crowd, or preempted and recomputed.

Nor do its prompt logprobs: the greedy target asks for them, so every comparison covers its prompt rows too
(chunked differently in the crowd, recomputed after preemption, with the LM head over other row counts).

Through the real Engine, TorchModelRunner and default CPU kernels, on the tiny
random model and on the default model. Greedy and seeded sampling both; any
difference in the logits' bits can flip a sample, so equality of whole token
streams over many steps is the evidence.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import named_config
from pagoda.model.factory import make_engine
from pagoda.model.llama import build_model
from pagoda.model.loader import load_model
from pagoda.kernels import cpu_native
from pagoda.model.matmul import BLOCKS, INT4, INT8, INT8_AVX2, ONEDNN_BF16
from pagoda.model.quantize import has_int_kernels
from pagoda.model.runner import TorchModelRunner
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=5)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


class RecordingRunner:
    """Wraps the runner and keeps every sampled logits row by (request id, position sampled)."""

    def __init__(self, inner: TorchModelRunner) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.row_multiple = inner.row_multiple
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self.max_chunks = 0  # the most requests one step carried
        self.max_adapters = 0  # the most LoRA adapters one step carried
        self.replays = 0  # decode steps replayed from a recorded graph (CPU step graphs, where the format has them)
        self.adapter_replays = 0  # of which with LoRA adapter rows

    def execute(self, batch):
        self.max_chunks = max(self.max_chunks, len(batch.chunks))
        self.max_adapters = max(self.max_adapters, len({c.request.adapter for c in batch.chunks} - {None}))
        graphs = self.inner.graphs
        before = getattr(graphs, "replays", 0)
        out = self.inner.execute(batch)
        replayed = getattr(graphs, "replays", 0) - before
        self.replays += replayed
        self.adapter_replays += replayed * any(c.request.adapter is not None for c in batch.chunks)
        rows = iter(out.logits)  # per chunk: its prompt rows, then its last token's row and one per draft
        for chunk in batch.logits_chunks:
            for _ in range(chunk.num_prompt_rows):  # prompt logprobs: compared as the engine reports them
                next(rows)
            for end in range(chunk.end, chunk.end + chunk.num_logits_rows - chunk.num_prompt_rows):
                # a row after a rejected draft is recorded too, and overwritten when that position is computed
                self.rows[(chunk.request.request_id, end)] = next(rows).clone()
        return out


def run(model, jobs, *, num_blocks=256, block_size=4, max_batched_tokens=64, max_running=16, ranks=None,
        adapters=None):
    """Run jobs [(rid, prompt, params[, adapter])] to completion; returns ({rid: tokens}, {rid: Request}, engine).

    `ranks`: the tensor-parallel group `model` is rank 0's shard of (tests/distributed).
    `adapters`: LoRA adapters {name: PEFT directory} loaded first, each of which may run in every step."""
    adapters = adapters or {}
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_running=max_running,
                          max_batched_tokens=max_batched_tokens, max_model_len=512, max_loras=max(len(adapters), 1),
                          max_lora_rank=64, enable_lora=bool(adapters))
    engine = make_engine(model, config, eos_token_ids=model.config.eos_token_ids, ranks=ranks)
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    engine.runner = RecordingRunner(engine.runner)
    requests = {job[0]: engine.add_request(*job[:3], adapter=job[3] if len(job) > 3 else None) for job in jobs}
    out: dict[str, list[int]] = {job[0]: [] for job in jobs}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
    return out, requests, engine


def crowd(vocab, n=8, seed=7, max_tokens=None, adapters=()):
    """n other requests of different prompt lengths and output lengths, some sampled; with `adapters`, the i-th on
    the base (None) or one of them, in turn."""
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (3 + 5 * i,), generator=gen).tolist()
        params = SamplingParams(max_tokens=max_tokens or 10 + 3 * i, temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
        choices = (None, *adapters)
        jobs.append((f"other{i}", prompt, params, choices[i % len(choices)]))
    return jobs


def assert_same_logits(engine, alone_rows, rid):
    """Every logits row the target sampled from has the same bits as when it ran alone."""
    rows = {key: row for key, row in engine.runner.rows.items() if key[0] == rid}
    assert len(rows) == 24
    for key, row in rows.items():
        assert torch.equal(row, alone_rows[key]), f"{rid}: logits at position {key[1]} differ in their bits"


def check_invariance(model, targets, *, tight_blocks, ranks=None, adapters=None):
    """targets: [(rid, prompt, params[, adapter])]. Alone == in a crowd == preempted and recomputed.

    `adapters` ({name: PEFT directory}): the crowds mix the base's rows with every adapter's, in the same steps."""
    vocab = model.config.vocab_size
    alone, alone_rows, alone_prompt = {}, {}, {}
    for rid, p, s, *adapter in targets:
        tokens, requests, engine = run(model, [(rid, p, s, *adapter)], ranks=ranks, adapters=adapters)
        alone[rid] = tokens[rid]
        alone_prompt[rid] = requests[rid].prompt_logprobs
        assert (s.prompt_logprobs is None) == (alone_prompt[rid] == [])
        assert all(t is not None for t in alone_prompt[rid]), "a prompt position was never scored"
        alone_rows.update(engine.runner.rows)
        assert len(alone[rid]) == 24
        # speculation is on by default: the proofs below cover accepted and rejected drafts (drafts ride in
        # padded rows, so a kernel without padding, int8/int4, has none)
        if s.greedy and engine.scheduler.row_multiple > 1:
            assert engine.stats()["spec_decode_accepted_tokens_total"] > 0, "no draft was accepted: the test proved less"

    # In a crowd: targets in the middle of 8 others; a small token budget cuts prompts
    # into chunks, so the targets' rows meet every batch size and row position.
    names = tuple(adapters or ())
    others = crowd(vocab, adapters=names)
    jobs = others[:4] + list(targets) + others[4:]
    in_crowd, requests, engine = run(model, jobs, max_batched_tokens=23, ranks=ranks, adapters=adapters)
    assert engine.runner.max_chunks >= 9  # at least one step carried nine requests
    if names:  # base rows and every adapter's in one step
        assert engine.runner.max_adapters == len(names)
    if engine.runner.inner.graphs is not None:  # step graphs: the crowd's decode steps were replays
        assert engine.runner.replays > 0
        assert engine.runner.adapter_replays > 0 or not names, "no step with adapter rows was replayed"
    for rid in alone:
        assert in_crowd[rid] == alone[rid], f"{rid} changed in a crowd"
        assert requests[rid].prompt_logprobs == alone_prompt[rid], f"{rid}'s prompt logprobs changed in a crowd"
        assert_same_logits(engine, alone_rows, rid)

    # Preempted: a pool that holds every prompt but not every output; the target arrives
    # last, so it is the newest running request and the first evicted, then recomputed
    # through prefill chunks once the others finish.
    long_others = crowd(vocab, n=4, seed=8, max_tokens=24, adapters=names)
    for rid, prompt, params, *adapter in targets:
        jobs = long_others + [(rid, prompt, params, *adapter)]
        preempted, requests, engine = run(model, jobs, num_blocks=tight_blocks, max_batched_tokens=19, ranks=ranks,
                                          adapters=adapters)
        assert engine.stats()["preemptions_total"] > 0
        assert requests[rid].num_preemptions > 0, f"{rid} was never preempted: the test proved nothing"
        assert preempted[rid] == alone[rid], f"{rid} changed after preemption and recompute"
        assert requests[rid].prompt_logprobs == alone_prompt[rid], f"{rid}'s prompt logprobs changed after preemption"
        assert_same_logits(engine, alone_rows, rid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_model_tokens_are_batch_invariant(dtype):
    model = build_model(named_config("tiny"), max_positions=512, dtype=dtype)  # bfloat16: onednn_bf16 where native
    model.init_random_weights(seed=5, std=0.1)
    gen = torch.Generator().manual_seed(11)
    targets = [
        ("greedy", torch.randint(3, 512, (13,), generator=gen).tolist(), GREEDY),
        ("sampled", torch.randint(3, 512, (22,), generator=gen).tolist(), SAMPLED),
    ]
    check_invariance(model, targets, tight_blocks=24)


needs_int = pytest.mark.skipif(not has_int_kernels(), reason="torch lacks the CPU int8/int4 weight kernels")


needs_avx2 = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")


@pytest.mark.parametrize("matmul", [pytest.param(INT8, marks=needs_int), pytest.param(INT4, marks=needs_int),
                                    pytest.param(INT8_AVX2, marks=needs_avx2), pytest.param(BLOCKS, marks=needs_avx2)],
                         ids=lambda k: k.name)
def test_tiny_model_tokens_are_batch_invariant_on_int_weights(matmul):
    model = build_model(named_config("tiny"), max_positions=512, matmul=matmul)
    model.init_random_weights(seed=5, std=0.1)  # quantized at packing, the LM head too
    gen = torch.Generator().manual_seed(11)
    targets = [
        ("greedy", torch.randint(3, 512, (13,), generator=gen).tolist(), GREEDY),
        ("sampled", torch.randint(3, 512, (22,), generator=gen).tolist(), SAMPLED),
    ]
    check_invariance(model, targets, tight_blocks=24)


@pytest.mark.parametrize("dtype, quantization", [
    ("float32", "none"),
    pytest.param("float32", "gguf", marks=needs_avx2),
    pytest.param("bfloat16", "none", marks=pytest.mark.slow),
    pytest.param("float32", "int8", marks=[needs_int, pytest.mark.slow]),
    pytest.param("float32", "int4", marks=[needs_int, pytest.mark.slow]),
], ids=["float32", "gguf", "bfloat16", "int8", "int4"])
def test_default_model_tokens_are_batch_invariant(default_model_dir, dtype, quantization):  # noqa: F811
    """Every CPU weight format: float32 (onednn_packed), the GGUF's own blocks (the default: CPU step graphs for
    its decode steps), bfloat16 (onednn_bf16, where native), int8 (int8_avx2 where it builds, step graphs too),
    int4."""
    model, _ = load_model(default_model_dir, dtype, "cpu", max_positions=512, quantization=quantization)
    if dtype == "bfloat16" and model.matmul is not ONEDNN_BF16:
        pytest.skip("no native bfloat16 products on this CPU")
    from pagoda.core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    targets = [
        ("greedy", tok.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]), GREEDY),
        ("sampled", tok.encode_chat([{"role": "user", "content": "Tell me a story about a fox."}]), SAMPLED),
    ]
    check_invariance(model, targets, tight_blocks=40)
