"""Which rows and columns each rank holds (pagoda/model/shard.py), and the loader reading only those."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from pagoda.distributed.group import partition
from pagoda.model.config import ModelConfigError, named_config
from pagoda.model.loader import read_shard
from pagoda.model.shard import ShardPlan


@given(n=st.integers(1, 10_000), size=st.integers(1, 64), unit=st.sampled_from([1, 16, 32]))
def test_partition_covers_everything_once_in_order_evenly_and_in_whole_units(n, size, unit):
    parts = [partition(n, size, r, unit) for r in range(size)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, in rank order
    assert all(start % unit == 0 for start, _ in parts)  # every part starts on a unit
    whole = [(end - start) // unit for start, end in parts[:-1]] + [(parts[-1][1] - parts[-1][0]) // unit]
    assert max(whole) - min(whole) <= 1  # parts differ by at most one unit (the last holds the rest besides)
    if n // unit >= size:
        assert min(end - start for start, end in parts) > 0  # ShardPlan refuses the other case


def test_the_default_models_heads_split_two_and_one_with_their_query_groups():
    # SmolLM2-135M: 9 query heads in 3 groups of 3 over 3 KV heads
    c = named_config("tiny", num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64, intermediate_size=1536,
                     vocab_size=49152)
    first, second = ShardPlan.of(c, 0, 2), ShardPlan.of(c, 1, 2)
    assert (first.kv_heads, first.q_heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.q_heads) == ((2, 3), (6, 9))
    assert first.intermediate == (0, 768) and second.intermediate == (768, 1536)
    assert first.vocab_sizes == second.vocab_sizes == (24576, 24576)
    assert first.adds_row_bias and not second.adds_row_bias
    assert second.rows("q_proj") == (6 * 64, 9 * 64) and second.columns("o_proj") == (6 * 64, 9 * 64)
    assert second.rows("k_proj") == (2 * 64, 3 * 64) and second.rows("input_layernorm") is None


def test_a_group_larger_than_the_kv_heads_or_the_units_is_refused_naming_the_field():
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        ShardPlan.of(named_config("tiny"), 0, 3)  # 2 KV heads
    with pytest.raises(ModelConfigError, match="intermediate_size"):
        ShardPlan.of(named_config("tiny", intermediate_size=32), 0, 2)  # one unit of 32 for two ranks


def test_the_loader_reads_only_the_shard_of_each_tensor(tmp_path):
    c = named_config("tiny")  # 4 heads of 16, 2 KV heads, intermediate 160, vocab 512
    torch.manual_seed(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 160),
        "model.layers.0.input_layernorm.weight": torch.randn(64),
        "model.embed_tokens.weight": torch.randn(512, 64),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    second = ShardPlan.of(c, 1, 2)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as reader:
        def part(name, shard=second):
            return read_shard(reader, name, shard)

        assert torch.equal(part("model.layers.0.self_attn.q_proj.weight"),
                           tensors["model.layers.0.self_attn.q_proj.weight"][32:])  # query heads 2, 3
        assert torch.equal(part("model.layers.0.self_attn.o_proj.weight"),
                           tensors["model.layers.0.self_attn.o_proj.weight"][:, 32:])
        assert part("model.layers.0.self_attn.o_proj.bias") is None  # rank 0 adds it
        assert torch.equal(part("model.layers.0.self_attn.o_proj.bias", ShardPlan.of(c, 0, 2)),
                           tensors["model.layers.0.self_attn.o_proj.bias"])
        assert torch.equal(part("model.layers.0.mlp.down_proj.weight"),  # 160 = 5 units of 32: 3 + 2
                           tensors["model.layers.0.mlp.down_proj.weight"][:, 96:])
        assert torch.equal(part("model.layers.0.input_layernorm.weight"),
                           tensors["model.layers.0.input_layernorm.weight"])
        assert torch.equal(part("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"][256:])


def test_a_group_the_model_cannot_split_over_is_refused_before_any_rank_starts(tiny_model_dir):
    from pagoda.core.tokenizer import Tokenizer
    from pagoda.model.factory import EngineOptions, load_engine

    import multiprocessing

    with pytest.raises(ModelConfigError, match="tensor_parallel_size 3 is more than the model's 2 key/value heads"):
        load_engine(tiny_model_dir, Tokenizer.from_dir(tiny_model_dir),
                    EngineOptions(model=str(tiny_model_dir), device="cpu", tensor_parallel_size=3))
    assert multiprocessing.active_children() == []  # nothing was spawned


def test_q4_1_blocks_shard_by_rows_and_by_whole_blocks_of_columns(tmp_path):
    c = named_config("tiny")  # intermediate 160: rank 1 of 2 holds columns 96..160, blocks 3..5
    blocks = {"model.layers.0.mlp.down_proj.weight": torch.randint(0, 255, (64, 5, 20), dtype=torch.uint8),
              "model.layers.0.mlp.up_proj.weight": torch.randint(0, 255, (160, 2, 20), dtype=torch.uint8)}
    save_file(blocks, str(tmp_path / "q.safetensors"))
    second = ShardPlan.of(c, 1, 2)
    with safe_open(str(tmp_path / "q.safetensors"), framework="pt") as reader:
        down = read_shard(reader, "model.layers.0.mlp.down_proj.weight", second, per=32)
        up = read_shard(reader, "model.layers.0.mlp.up_proj.weight", second, per=32)
    assert torch.equal(down, blocks["model.layers.0.mlp.down_proj.weight"][:, 3:])
    assert torch.equal(up, blocks["model.layers.0.mlp.up_proj.weight"][96:])
