"""Which part of every weight one tensor-parallel rank holds.

Design note (after Megatron-LM's layout, as nano-vllm and gpt-fast use it):

- q/k/v and gate/up are column-parallel: a rank holds whole heads, and the rows of gate and up
  for its part of the intermediate size. Heads are split by key/value head, each with its group
  of query heads (GQA), so a rank's attention reads only its own K/V: the KV cache is split by
  heads too. Parts are contiguous and differ by at most one head: the default model's 3 KV heads
  (9 query heads) go 2 + 1 over two ranks; a group larger than the KV head count is refused.
- o and down are row-parallel: a rank holds the input columns its heads (its intermediate part)
  produce, multiplies them, and the group sums the partial results (`TensorGroup.all_reduce`):
  two all-reduces a layer. Their biases are added by rank 0 alone, so they are added once.
- The embedding and the LM head are vocab-parallel: a rank holds a contiguous part of the
  vocabulary's rows. The lookup masks the ids outside it, and the group sums (one term is the
  row, the others exact zeros); the head's logits are gathered on rank 0, which samples.
- The norms are replicated: every rank holds the whole hidden state between layers.
- The intermediate size and the vocabulary are split in units of 32 (QUANT_UNIT): int4 packs
  groups of 32 inputs and 16 outputs, int8 multiples of 8, so every rank's shard of a quantized
  model packs, and a shard of a GGUF's Q4_1 blocks never splits a block.

A group of one holds everything (`ShardPlan.whole`): the single-process model, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.distributed.group import partition
from pagoda.model.config import ModelConfig, ModelConfigError

QUANT_UNIT = 32  # the intermediate and vocabulary parts are whole multiples of this (the design note)


@dataclass(frozen=True)
class ShardPlan:
    """The part of the model rank `rank` of `size` holds: head, intermediate and vocabulary ranges."""

    rank: int
    size: int
    kv_heads: tuple[int, int]  # [start, end) of the key/value heads
    q_heads: tuple[int, int]  # their query heads
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary part, in rank order (the logits gather)
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        if config.num_experts and size > 1:
            raise ModelConfigError(f"tensor_parallel_size {size}: a mixture of experts (num_experts = "
                                   f"{config.num_experts}) is not split over ranks; run it with one")
        if size > config.num_key_value_heads:
            raise ModelConfigError(
                f"tensor_parallel_size {size} is more than the model's {config.num_key_value_heads} key/value heads "
                "(num_key_value_heads): each rank needs whole heads")
        for field, n in (("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
            if size > 1 and n // QUANT_UNIT < size:
                raise ModelConfigError(f"tensor_parallel_size {size} leaves a rank no part of {field} ({n}): "
                                       f"each rank needs at least {QUANT_UNIT}")
        group = config.num_attention_heads // config.num_key_value_heads
        kv = partition(config.num_key_value_heads, size, rank)
        return cls(rank=rank, size=size, kv_heads=kv, q_heads=(kv[0] * group, kv[1] * group),
                   intermediate=partition(config.intermediate_size, size, rank, QUANT_UNIT),
                   vocab=partition(config.vocab_size, size, rank, QUANT_UNIT),
                   vocab_sizes=tuple(_width(partition(config.vocab_size, size, r, QUANT_UNIT)) for r in range(size)),
                   head_dim=config.head_dim)

    @classmethod
    def whole(cls, config: ModelConfig) -> ShardPlan:
        return cls.of(config, 0, 1)

    @property
    def num_heads(self) -> int:
        return _width(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return _width(self.kv_heads)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        return _width(self.intermediate)

    @property
    def vocab_size(self) -> int:
        return _width(self.vocab)

    @property
    def adds_row_bias(self) -> bool:
        """Whether this rank adds the row-parallel layers' biases (one rank does)."""
        return self.rank == 0

    def rows(self, proj: str) -> tuple[int, int] | None:
        """[start, end) of the output rows of a column-parallel (or vocab-parallel) weight; None: all of them."""
        d = self.head_dim
        if proj == "q_proj":
            return self.q_heads[0] * d, self.q_heads[1] * d
        if proj in ("k_proj", "v_proj"):
            return self.kv_heads[0] * d, self.kv_heads[1] * d
        if proj in ("gate_proj", "up_proj"):
            return self.intermediate
        if proj in ("embed_tokens", "lm_head"):
            return self.vocab
        return None

    def columns(self, proj: str) -> tuple[int, int] | None:
        """[start, end) of the input columns of a row-parallel weight; None: all of them."""
        if proj == "o_proj":
            return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim
        if proj == "down_proj":
            return self.intermediate
        return None


def _width(span: tuple[int, int]) -> int:
    return span[1] - span[0]
