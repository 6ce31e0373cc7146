"""A Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, paged batch.

There is no batch axis and no padding to the longest sequence: one step's new
tokens of every sequence are concatenated into one axis of T rows. Attention
is the only operation that needs to know where one sequence ends and the next
begins; it reads that from `AttentionMetadata` and reads earlier tokens' K/V
from the paged cache, after this step's K/V were written there.

The input may carry extra trailing rows (`StepContext.num_tokens` < rows):
they run through the linear layers and nothing else, so that matrix products
always see a row count the caller chose (see `runner.py` on batch invariance).

Weights are named as in Hugging Face checkpoints, except that q/k/v and
gate/up are stored stacked (`qkv_proj`, `gate_up_proj`): one matrix product
instead of three or two (`loader.load_weights` maps the checkpoint's names).
Every product runs on the model's `MatmulKernel` (`matmul.py`).

Under tensor parallelism a model holds one rank's shard (`shard.py`: whole heads, part of the
intermediate size and of the vocabulary) and sums its partial results with the other ranks'
through its `TensorGroup`: after o_proj, after down_proj and after the embedding lookup; its
logits are gathered on rank 0. A group of one holds the whole model and never communicates.

`reference_forward` is the plain path beside the paged one: dense causal
attention over one sequence, used by tests as the oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagoda.distributed.group import SOLO, TensorGroup
from pagoda.kernels import cpu_native
from pagoda.model.config import ModelConfig
from pagoda.model.shard import ShardPlan
from pagoda.model.matmul import ONEDNN_BF16, PLAIN, Linear, MatmulKernel, PackedWeight, select_matmul


class LinearThreads(Protocol):
    """Where a step's linear layers run; the rest of the step runs on the threads it was called on (the runner's
    choice: pagoda/model/runner.py, StepThreads)."""

    def linear(self, layer: nn.Module, x: Tensor) -> Tensor:
        """layer(x), on the threads the step gives its linear layers."""
        ...


class SameThreads:
    """Linear layers on the threads the step runs on (no switch): GPUs, the reference path, big CPU steps."""

    def linear(self, layer: nn.Module, x: Tensor) -> Tensor:
        return layer(x)


SAME_THREADS = SameThreads()


@dataclass
class StepContext:
    """What attention needs for one forward besides the hidden states, and where the linear layers run."""

    meta: Any  # pagoda.kernels.AttentionMetadata for the first `num_tokens` rows
    kv_caches: list[tuple[Tensor, Tensor]]  # per layer (k, v), each [num_blocks, block_size, n_kv_heads, head_dim]
    backend: Any  # pagoda.kernels.AttentionBackend
    num_tokens: int  # real rows; rows beyond are padding
    threads: LinearThreads = SAME_THREADS  # the runner's StepThreads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, H]. Statistics in float32 whatever the weights' dtype; in place on fresh tensors
        # (the same products and sums in the same order, so the same bits as the out-of-place form).
        # float32 rows on an AVX2 CPU: the same formula in one C++ call (pagoda/kernels/cpu_native.py).
        if x.dtype is self.weight.dtype is torch.float32 and x.dim() == 2 and x.is_cpu and cpu_native.available():
            return cpu_native.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = (x32 * x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).to(x.dtype)
        return normed.mul_(self.weight)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (float32), with Llama 3 scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: frequencies whose wavelength exceeds the original context are
    # slowed by `factor`, short wavelengths are kept, and the band between is
    # interpolated linearly in (context / wavelength).
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    short_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
    mix = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - mix) * scaled / s.factor + mix * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables [max_positions, head_dim] in float32.

    Rotate-half convention: out = x * cos + cat(x2, x1) * sin_signed, where
    sin_signed = cat(-sin, sin) carries rotate_half's negation (exact in IEEE).
    """
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * rope_inv_freq(config)[None, :]  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x: [T, heads, D]; cos, sin_signed: [T, D] -> [T, heads, D]."""
    if (x.dtype is cos.dtype is torch.float32 and x.is_cpu and x.shape[-1] % 16 == 0 and x.stride(-1) == 1
            and cpu_native.available()):
        return cpu_native.rope(x, cos, sin_signed)  # the same bits in one C++ call
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), -1).mul_(sin_signed[:, None, :])
    return torch.mul(x, cos[:, None, :]).add_(swapped)  # x * cos + swapped * sin, without temporaries


class Attention(nn.Module):
    """This rank's heads (all of them in a group of one): q/k/v column-parallel, o row-parallel."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.scale = self.head_dim ** -0.5
        self.group = group
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, matmul, **factory)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias and shard.adds_row_bias, matmul,
                             **factory)

    def _qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # qkv: the projection of x [Tp, H], over all Tp rows (its row count is what keeps it batch invariant)
        # -> q [n, nh, D], k and v [n, nkv, D] for the first n = len(cos) rows.
        t = cos.shape[0]
        qkv = qkv[:t]
        # q and k heads are adjacent columns: rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        # x: [Tp, H], of which the first n rows are real; cos, sin: [n, D]
        n = ctx.num_tokens
        q, k, v = self._qkv(ctx.threads.linear(self.qkv_proj, x), cos, sin)
        k_cache, v_cache = kv_cache
        ctx.backend.write_kv(k_cache, v_cache, k, v, ctx.meta.slot_mapping)
        out = ctx.backend.attention(q.contiguous(), k_cache, v_cache, ctx.meta, self.scale)  # [n, nh, D]
        out = out.reshape(n, self.q_size)
        if x.shape[0] > n:  # padding rows carry zeros into o_proj
            out = torch.cat((out, out.new_zeros(x.shape[0] - n, self.q_size)))
        return self.group.all_reduce(ctx.threads.linear(self.o_proj, out))

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Plain causal attention over one whole sequence x [T, H] (the test oracle)."""
        q, k, v = self._qkv(self.qkv_proj(x), cos, sin)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # SDPA wants [heads, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.group.all_reduce(self.o_proj(out.transpose(0, 1).reshape(x.shape[0], self.q_size)))


class MLP(nn.Module):
    """This rank's part of the intermediate size: gate/up column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.intermediate_size = shard.intermediate_size
        self.group = group
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, config.mlp_bias, matmul, **factory)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, config.mlp_bias and shard.adds_row_bias,
                                matmul, **factory)

    def forward(self, x: Tensor, threads: LinearThreads = SAME_THREADS) -> Tensor:
        # x: [T, H] -> gate, up: [T, I] -> [T, H]
        gate, up = threads.linear(self.gate_up_proj, x).split(self.intermediate_size, dim=-1)
        return self.group.all_reduce(threads.linear(self.down_proj, F.silu(gate).mul_(up)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, matmul, shard, group, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, matmul, shard, group, **factory)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        # the residual adds land in the sublayers' fresh outputs (a + x is x + a, bit for bit)
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, ctx).add_(x)
        return self.mlp(self.post_attention_layernorm(h), ctx.threads).add_(h)


class VocabEmbedding(nn.Embedding):
    """The embedding of this rank's part of the vocabulary (all of it in a group of one).

    A vocab-parallel lookup: ids outside the part look up its first row and are zeroed, and the
    group sums the ranks' rows, exactly (the one real row plus zeros)."""

    def __init__(self, shard: ShardPlan, hidden_size: int, group: TensorGroup, **factory: Any) -> None:
        super().__init__(shard.vocab_size, hidden_size, **factory)
        self.start, self.end = shard.vocab
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        if not self.group.communicates:
            return super().forward(ids)
        inside = (ids >= self.start) & (ids < self.end)
        rows = super().forward(torch.where(inside, ids - self.start, 0))
        return self.group.all_reduce(rows.masked_fill_(~inside.unsqueeze(-1), 0.0))


class DecoderStack(nn.Module):
    """Embedding, layers and final norm: named like HF's `model.*`."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(shard, config.hidden_size, group, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, matmul, shard, group, **factory)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, *, matmul: MatmulKernel = PLAIN,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 shard: ShardPlan | None = None, group: TensorGroup = SOLO) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = config
        self.matmul = matmul
        self.shard = shard or ShardPlan.whole(config)  # what this rank holds (everything in a group of one)
        self.group = group
        self.max_positions = max_positions or config.max_position_embeddings
        self.model = DecoderStack(config, matmul, self.shard, group, **factory)
        self.lm_head = None  # tied: the LM head is the embedding matrix
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, self.shard.vocab_size, False, matmul, **factory)
        self.lm_head_packed = PackedWeight(matmul)
        self.register_buffer("rope_cos", torch.empty(self.max_positions, config.head_dim, **factory), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.max_positions, config.head_dim, **factory), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the RoPE tables in float32, stored in the model's dtype (after `to_empty`)."""
        cos, sin = rope_tables(self.config, self.max_positions)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _packs(self) -> list[tuple[PackedWeight, Tensor]]:
        # an untied LM head multiplies through lm_head_packed, not through its Linear
        packs = [(m.packed, m.weight) for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]
        return packs + [(self.lm_head_packed, self.lm_head_weight)]

    def pack_weights(self, release: bool = False) -> None:
        """Reorder every matmul weight into the kernel's layout once.

        A copy: with `release` the plain weights of the linear layers are freed (not the embedding,
        which a tied LM head shares and the lookup reads), so packing costs no extra memory.
        """
        for packed, weight in self._packs():
            packed.pack(weight, release=release and packed is not self.lm_head_packed)

    def matmul_bytes(self) -> int:
        """Bytes of matmul weights one forward reads, in the layout they are multiplied in."""
        return sum(packed.nbytes(weight) for packed, weight in self._packs())

    def unpack_weights(self) -> None:
        """Drop the reordered copies; products read the plain weights again."""
        for packed, _ in self._packs():
            packed.clear()

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: StepContext) -> Tensor:
        """input_ids, positions: [Tp] -> final-normed hidden states [Tp, H]."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        assert len(ctx.kv_caches) == len(self.model.layers)
        real = positions[: ctx.num_tokens]
        cos, sin = self.rope_cos[real], self.rope_sin[real]  # [n, D]
        h = self.model.embed_tokens(input_ids)  # [Tp, H]
        for layer, kv_cache in zip(self.model.layers, ctx.kv_caches):
            h = layer(h, cos, sin, kv_cache, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden: [S, H] (the rows that sample) -> logits [S, V] in float32 (on rank 0; None on the others)."""
        # the LM head may run on its own kernel (a float head over int4 layers): lm_head_packed's
        logits = self.lm_head_packed.matmul.linear(hidden, self.lm_head_packed.operand(self.lm_head_weight), None)
        return self.group.gather_first(logits.float(), list(self.shard.vocab_sizes))

    def reference_forward(self, input_ids: Tensor) -> Tensor:
        """Dense, unpaged forward of one sequence: input_ids [T] -> logits [T, V] (the test oracle)."""
        cos, sin = self.rope_cos[: input_ids.shape[0]], self.rope_sin[: input_ids.shape[0]]
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.compute_logits(self.model.norm(h))

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight from a seeded normal (norms get 1 + noise): for tests and benchmarks."""
        self.unpack_weights()  # the packs would be stale (writes through .data keep the version)
        gens: dict[torch.device, torch.Generator] = {}
        for name, p in sorted(self.named_parameters()):
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std
            p.data.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                max_positions: int | None = None, matmul: MatmulKernel | str | None = None,
                shard: ShardPlan | None = None, group: TensorGroup = SOLO) -> Transformer:
    """A Transformer with uninitialised weights allocated directly on `device` (fill with load_weights).

    `matmul` defaults to `select_matmul(device, dtype)`; a name picks one of the kernels.
    `shard` and `group`: this rank's part of a tensor-parallel model (default: all of it, alone).
    On a CPU with native bfloat16 products, bfloat16 means bfloat16 weights (`onednn_bf16`, packed by
    the runner) and a float32 model around them: the CPU's elementwise ops and attention are slower in
    bfloat16 than in float32, and float32 activations, norms and KV cache keep the rounding to the weights.
    """
    if not isinstance(matmul, MatmulKernel):
        matmul = select_matmul(device, dtype, matmul)
    if matmul is ONEDNN_BF16:
        dtype = torch.float32  # the kernel holds the bfloat16 copy of each weight
    model = Transformer(config, max_positions, matmul=matmul, dtype=dtype, device="meta", shard=shard, group=group)
    model.to_empty(device=device)
    model.init_rope()
    return model.eval().requires_grad_(False)
