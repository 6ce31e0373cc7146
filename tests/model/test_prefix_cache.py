"""Prefix caching on the real model: a cached prefix is bit for bit the prefix a fresh prefill computes.

Through the real Engine, TorchModelRunner and default CPU kernels on the tiny
random model. A prompt whose first blocks come from the cache (written by an
earlier request, cut into other chunks) must see the same KV at every position,
the same logits and the same greedy tokens as the same prompt prefilled fresh
with the cache off; and a crowd sharing a system prompt must get the same tokens
with the cache on and off.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.model import factory
from pagoda.model.config import named_config
from pagoda.model.llama import build_model
from tests.model.test_batch_invariance import RecordingRunner

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    model = build_model(named_config("tiny"), max_positions=512)
    model.init_random_weights(seed=5, std=0.1)
    return model


def make_engine(model, *, caching: bool, max_batched_tokens: int, num_blocks: int = 64) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_running=16,
                          max_batched_tokens=max_batched_tokens, max_model_len=512, enable_prefix_caching=caching)
    engine = factory.make_engine(model, config, eos_token_ids=model.config.eos_token_ids)
    engine.runner = RecordingRunner(engine.runner)
    return engine


def step_until(engine: Engine, done, limit: int = 1000) -> dict[str, list[int]]:
    """Step (auditing each time) until `done()`; returns the tokens each request got."""
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        if done():
            return out
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.audit()
    raise AssertionError("the engine did not get there")


def kv_at_every_position(engine: Engine, request_id: str, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) [length, kv_heads, head_dim] of positions 0..length-1, read through the block table."""
    table = torch.tensor(engine.block_manager.block_table(request_id))
    pos = torch.arange(length)
    blocks, offsets = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
    return [(k[blocks, offsets].clone(), v[blocks, offsets].clone()) for k, v in engine.runner.inner.kv_caches]


def rows_of(engine: Engine, request_id: str) -> dict[int, torch.Tensor]:
    return {pos: row for (rid, pos), row in engine.runner.rows.items() if rid == request_id}


@pytest.mark.parametrize("tail", [7, 0], ids=["prefix-and-more", "whole-prompt-cached"])
def test_a_cached_prefix_gives_bit_identical_kv_logits_and_tokens(model, tail):
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 512, (16,), generator=gen).tolist()  # four full blocks
    writer = prefix + torch.randint(3, 512, (5,), generator=gen).tolist()
    reader = prefix + torch.randint(3, 512, (tail,), generator=gen).tolist()

    # The cache: the writer's prompt prefilled in chunks of 5, then the reader takes its first blocks.
    cached = make_engine(model, caching=True, max_batched_tokens=5)
    cached.add_request("writer", writer, GREEDY)
    step_until(cached, lambda: not cached.has_unfinished())
    r = cached.add_request("reader", reader, GREEDY)
    tokens_cached = step_until(cached, lambda: r.num_computed_tokens >= len(reader))["reader"]
    # With a whole prompt cached, the block of its last token is recomputed, not shared.
    want_cached = 16 if tail else 12
    assert r.num_cached_tokens == want_cached and cached.stats()["prefix_cache_hit_tokens_total"] == want_cached
    kv_cached = kv_at_every_position(cached, "reader", len(reader))
    tokens_cached += step_until(cached, lambda: not cached.has_unfinished())["reader"]

    # Fresh: the same prompt alone with the cache off, prefilled in one chunk.
    fresh = make_engine(model, caching=False, max_batched_tokens=64)
    f = fresh.add_request("reader", reader, GREEDY)
    tokens_fresh = step_until(fresh, lambda: f.num_computed_tokens >= len(reader))["reader"]
    assert f.num_cached_tokens == 0
    kv_fresh = kv_at_every_position(fresh, "reader", len(reader))
    tokens_fresh += step_until(fresh, lambda: not fresh.has_unfinished())["reader"]

    for layer, ((k1, v1), (k2, v2)) in enumerate(zip(kv_cached, kv_fresh)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2), f"layer {layer}: cached KV differs from a fresh prefill"
    rows_cached, rows_fresh = rows_of(cached, "reader"), rows_of(fresh, "reader")
    assert rows_cached.keys() == rows_fresh.keys() and len(rows_fresh) == GREEDY.max_tokens
    for pos, row in rows_fresh.items():
        assert torch.equal(rows_cached[pos], row), f"logits at position {pos} differ in their bits"
    assert len(tokens_fresh) == GREEDY.max_tokens and tokens_cached == tokens_fresh


def shared_prompt_waves(vocab: int) -> list[list[tuple[str, list[int], SamplingParams]]]:
    """Three waves of clients sharing a 13-token system prompt: greedy and seeded, short and long."""
    gen = torch.Generator().manual_seed(9)
    system = torch.randint(3, vocab, (13,), generator=gen).tolist()
    waves = []
    for w in range(3):
        wave = []
        for i in range(3):
            n = 4 * w + i
            own = torch.randint(3, vocab, (1 + 3 * i,), generator=gen).tolist()
            params = SamplingParams(max_tokens=10 + 2 * i, temperature=0.8 * (n % 2), seed=n, ignore_eos=True)
            wave.append((f"c{n}", system + own, params))
        waves.append(wave)
    return waves


def run_waves(model, waves, *, caching: bool, num_blocks: int) -> tuple[dict[str, list[int]], Engine]:
    engine = make_engine(model, caching=caching, max_batched_tokens=23, num_blocks=num_blocks)
    out: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt, params in wave:
            engine.add_request(rid, prompt, params)
        start = engine.counters.steps_total
        # three steps: the wave's prompts are computed (and cached) before the next wave arrives
        for rid, tokens in step_until(engine, lambda: engine.counters.steps_total >= start + 3).items():
            out.setdefault(rid, []).extend(tokens)
    for rid, tokens in step_until(engine, lambda: not engine.has_unfinished()).items():
        out.setdefault(rid, []).extend(tokens)
    return out, engine


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy", "tight-preempts"])
def test_a_crowd_gets_the_same_tokens_with_the_cache_on_and_off(model, num_blocks):
    waves = shared_prompt_waves(model.config.vocab_size)
    on, engine_on = run_waves(model, waves, caching=True, num_blocks=num_blocks)
    off, engine_off = run_waves(model, waves, caching=False, num_blocks=num_blocks)
    assert engine_on.stats()["prefix_cache_hit_tokens_total"] >= 6 * 12  # waves 2 and 3 reuse the system prompt
    if num_blocks == 20:
        assert engine_on.stats()["preemptions_total"] > 0, "the tight pool never preempted: the case proved nothing"
    assert on == off
    for key, row in engine_off.runner.rows.items():
        assert torch.equal(engine_on.runner.rows[key], row), f"{key}: logits differ with the cache on"
    assert engine_on.block_manager.num_free_blocks == num_blocks
