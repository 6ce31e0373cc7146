"""N-gram drafts in the padded rows give the plain greedy tokens, on the real runner and models.

The claim rests on batch invariance: a draft's logits row is computed like
any row of a prefill chunk, so it has the bits the plain decode's row has
(checked row by row here), and greedy verification then keeps exactly the
plain tokens. The end-to-end checks run the real Engine with speculation on
and off and require identical token streams and some accepted drafts.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.batch import ScheduledChunk, SchedulerOutput
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.config import named_config
from pagoda.model.factory import make_engine
from pagoda.model.llama import build_model
from pagoda.model.loader import load_model
from pagoda.model.runner import TorchModelRunner
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture)

BLOCK_SIZE = 4


def tiny(dtype=torch.float32):
    model = build_model(named_config("tiny"), max_positions=512, dtype=dtype)
    model.init_random_weights(seed=5, std=0.1)
    return model


def step(runner, req, start, num_tokens, drafts=()):
    end = start + num_tokens + len(drafts)
    chunk = ScheduledChunk(req, start, num_tokens, tuple(range(-(-end // BLOCK_SIZE))), tuple(drafts))
    return runner.execute(SchedulerOutput([chunk], BLOCK_SIZE)).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_chunk_with_drafts_returns_the_plain_decodes_rows_bit_for_bit(dtype):
    config = EngineConfig(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    following = [17, 230, 41]
    # plain: the prompt, then one decode per following token
    plain_runner = TorchModelRunner(tiny(dtype), config)
    req = Request("a", list(prompt), SamplingParams(max_tokens=8))
    plain = [step(plain_runner, req, 0, len(prompt))[0]]
    for token in following:
        req.output_token_ids.append(token)
        plain.append(step(plain_runner, req, req.num_tokens - 1, 1)[0])
    # speculated: the prompt, then its last token and the three drafts in one chunk of four rows
    spec_runner = TorchModelRunner(tiny(dtype), config)
    req = Request("a", list(prompt), SamplingParams(max_tokens=8))
    step(spec_runner, req, 0, len(prompt) - 1)
    rows = step(spec_runner, req, len(prompt) - 1, 1, following)
    assert rows.shape == (4, spec_runner.vocab_size)
    for j, row in enumerate(rows):
        assert torch.equal(row, plain[j]), f"draft row {j} differs from the plain decode's bits"


def greedy_run(model, prompts, spec, max_tokens=48, **config):
    """Greedy tokens per prompt with `spec` (None = off), auditing the pool after every step; and the stats."""
    cfg = dict(num_blocks=256, block_size=BLOCK_SIZE, max_running=8, max_batched_tokens=64, max_model_len=512)
    engine = make_engine(model, EngineConfig(**{**cfg, **config}, speculative=spec),
                         eos_token_ids=model.config.eos_token_ids)
    if spec is not None and not engine.speculation.active:  # this machine's kernel pads no rows: nothing to test
        assert "pads no rows" in engine.speculation.reason, engine.speculation.reason
        pytest.skip(f"{model.matmul.name} here: speculative decoding {engine.speculation.reason}")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
        engine.audit()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out, engine.stats()


def assert_same_with_drafts(model, prompts, **config):
    plain, plain_stats = greedy_run(model, prompts, None, **config)
    spec, stats = greedy_run(model, prompts, SpeculativeConfig(), **config)
    assert spec == plain, "speculation changed the greedy tokens"
    assert stats["spec_decode_accepted_tokens_total"] > 0, "no draft was accepted: the test proved less"
    assert plain_stats["spec_decode_draft_tokens_total"] == 0
    return stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_model_greedy_tokens_are_the_same_with_drafts(dtype):
    model = tiny(dtype)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (5 + 7 * i,), generator=gen).tolist() for i in range(3)]
    assert_same_with_drafts(model, prompts[:1])  # alone: three padded rows a step
    assert_same_with_drafts(model, prompts)  # together: fewer spare rows, shared by three
    # a pool too small for all three: the newest is preempted, recomputed, and speculates again
    stats = assert_same_with_drafts(model, prompts, num_blocks=24, max_batched_tokens=19)
    assert stats["preemptions_total"] > 0, "nothing was preempted: the test proved less"


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_default_model_greedy_tokens_are_the_same_with_drafts(default_model_dir, dtype):  # noqa: F811
    from pagoda.core.tokenizer import Tokenizer

    model, _ = load_model(default_model_dir, dtype, "cpu", max_positions=512)
    tok = Tokenizer.from_dir(default_model_dir)
    text = "red, green, blue, red, green, blue, red, green, blue, red, green, blue"
    prompts = [tok.encode_chat([{"role": "user", "content": f"Repeat this list five more times: {text}"}]),
               tok.encode_chat([{"role": "user", "content": "Count from 1 to 40, separated by commas."}])]
    stats = assert_same_with_drafts(model, prompts[:1])
    assert stats["spec_decode_accepted_tokens_total"] >= 10  # a repetitive answer: many drafts kept
    assert_same_with_drafts(model, prompts)
