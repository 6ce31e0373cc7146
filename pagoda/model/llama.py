"""pagoda's decoder layers, and the Llama-shaped decoder built from them, over a flattened, paged batch.

Every architecture plugin (pagoda/model/families/) builds its model here: Llama, Mistral and Qwen2 as
they are; Qwen3 and Gemma 3 with the q/k norms, Gemma's (1 + w) norms, embedding scale and GeGLU, and
sliding-window layers (which read their window from the config, per layer); Gemma 3 and Qwen3-MoE with
a decoder layer of their own (`Transformer(layer=...)`), built from the same parts.

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
from collections.abc import Callable
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
    """x / rms(x) * (offset + weight): offset 0 for Llama, 1 for Gemma (whose weights are stored as w - 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, **factory: Any) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, H]. Statistics in float32 whatever the weights' dtype; in place on fresh tensors
        # (the same products and sums in the same order, so the same bits as the out-of-place form).
        # float32 rows on an AVX2 CPU: the same formula in one C++ call (pagoda/kernels/cpu_native.py).
        weight = self.weight if not self.offset else self.weight + self.offset  # [H], as Gemma's (1.0 + w)
        if x.dtype is weight.dtype is torch.float32 and x.dim() == 2 and x.is_cpu and cpu_native.available():
            return cpu_native.rms_norm(x, weight, self.eps)
        x32 = x.float()
        normed = (x32 * x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).to(x.dtype)
        return normed.mul_(weight)

    def heads(self, x: Tensor) -> Tensor:
        """x: [T, heads, D] -> each head normed over D (the q/k norms of Qwen3 and Gemma 3)."""
        return self(x.reshape(-1, x.shape[-1])).view(x.shape)


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (float32), with the config's scaling if any.

    `local`: the sliding layers' RoPE where the config gives them a base of their own (Gemma 3), unscaled."""
    dim = config.head_dim
    theta, s = (config.rope_local_theta, None) if local else (config.rope_theta, config.rope_scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if s is None:
        return inv_freq
    if s.rope_type == "linear":  # position interpolation: every position divided by the factor
        return inv_freq / s.factor
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


def rope_tables(config: ModelConfig, max_positions: int, *, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables [max_positions, head_dim] in float32 (`local`: the sliding layers').

    Rotate-half convention: out = x * cos + cat(x2, x1) * sin_signed, where
    sin_signed = cat(-sin, sin) carries rotate_half's negation (exact in IEEE).
    """
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * rope_inv_freq(config, local=local)[None, :]  # [P, D/2]
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
    """This rank's heads (all of them in a group of one): q/k/v column-parallel, o row-parallel.

    What the config says of layer `index`: its sliding window (0: it sees every key), the soft cap on its
    scores, its scale, whether q and k heads are normed before RoPE, and which RoPE table it rotates by
    (`rope_index` 1: the sliding layers' own, where the config gives them one)."""

    def __init__(self, config: ModelConfig, index: int, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.scale = config.attention_scale or self.head_dim ** -0.5
        self.window, self.softcap = config.layer_window(index), config.attn_logit_softcapping
        self.rope_index = 1 if self.window and config.rope_local_theta else 0
        # the backends' defaults are a full window and no cap: a Llama layer passes nothing
        self.attention_options = {k: v for k, v in (("sliding_window", self.window), ("softcap", self.softcap)) if v}
        self.group = group
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, matmul, **factory)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias and shard.adds_row_bias, matmul,
                             **factory)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_offset, **factory)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_offset, **factory)

    def _qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # qkv: the projection of x [Tp, H], over all Tp rows (its row count is what keeps it batch invariant)
        # -> q [n, nh, D], k and v [n, nkv, D] for the first n = len(cos) rows.
        t = cos.shape[0]
        qkv = qkv[:t]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head normed on its own, then rotated
            q = self.q_norm.heads(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm.heads(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        # q and k heads are adjacent columns: rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        # x: [Tp, H], of which the first n rows are real; cos, sin: [n, D]
        n = ctx.num_tokens
        q, k, v = self._qkv(ctx.threads.linear(self.qkv_proj, x), cos, sin)
        k_cache, v_cache = kv_cache
        ctx.backend.write_kv(k_cache, v_cache, k, v, ctx.meta.slot_mapping)
        out = ctx.backend.attention(q.contiguous(), k_cache, v_cache, ctx.meta, self.scale,
                                    **self.attention_options)  # [n, nh, D]
        out = out.reshape(n, self.q_size)
        if x.shape[0] > n:  # padding rows carry zeros into o_proj
            out = torch.cat((out, out.new_zeros(x.shape[0] - n, self.q_size)))
        return self.group.all_reduce(ctx.threads.linear(self.o_proj, out))

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Plain causal attention over one whole sequence x [T, H] (the test oracle)."""
        q, k, v = self._qkv(self.qkv_proj(x), cos, sin)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, D]
        if not self.attention_options:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # a window or a cap: the scores written out
            scores = (q @ k.transpose(1, 2)) * self.scale  # [heads, T, T]
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            pos = torch.arange(x.shape[0], device=x.device)
            hidden = pos[None, :] > pos[:, None]  # [T(query), T(key)]: the future
            if self.window:
                hidden |= pos[None, :] <= pos[:, None] - self.window
            out = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v
        return self.group.all_reduce(self.o_proj(out.transpose(0, 1).reshape(x.shape[0], self.q_size)))


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated(gate_up: Tensor, activation: str) -> Tensor:
    """act(gate) * up of a stacked [T, 2I] gate/up projection: one C++ call on a CPU (cpu_native.act_mul, whose
    bits a recorded step replays), torch's ops elsewhere."""
    if (gate_up.dtype is torch.float32 and gate_up.dim() == 2 and gate_up.is_cpu and gate_up.stride(-1) == 1
            and activation in cpu_native.ACTIVATIONS and cpu_native.available()):
        return cpu_native.act_mul(gate_up, activation)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return ACTIVATIONS[activation](gate).mul_(up)


class MLP(nn.Module):
    """This rank's part of the intermediate size: gate/up column-parallel, down row-parallel (SwiGLU or GeGLU)."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.intermediate_size = shard.intermediate_size
        self.group = group
        self.activation = config.hidden_act
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, config.mlp_bias, matmul, **factory)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, config.mlp_bias and shard.adds_row_bias,
                                matmul, **factory)

    def forward(self, x: Tensor, threads: LinearThreads = SAME_THREADS) -> Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, I] -> [T, H]
        return self.group.all_reduce(threads.linear(self.down_proj, gated(threads.linear(self.gate_up_proj, x),
                                                                          self.activation)))


class DecoderLayer(nn.Module):
    """A pre-norm layer: x + attention(norm(x)), then h + mlp(norm(h)) (Llama, Mistral, Qwen2/3, Phi-3)."""

    def __init__(self, config: ModelConfig, index: int, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)
        self.self_attn = Attention(config, index, matmul, shard, group, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)
        self.mlp = MLP(config, matmul, shard, group, **factory)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        # the residual adds land in the sublayers' fresh outputs (a + x is x + a, bit for bit)
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, ctx).add_(x)
        return self.mlp(self.post_attention_layernorm(h), ctx.threads).add_(h)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The layer over one whole sequence x [T, H] with plain attention (the test oracle)."""
        h = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


LayerFactory = Callable[..., nn.Module]  # (config, index, matmul, shard, group, **factory) -> a decoder layer


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
                 layer: LayerFactory, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(shard, config.hidden_size, group, **factory)
        self.layers = nn.ModuleList(layer(config, i, matmul, shard, group, **factory)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, *, matmul: MatmulKernel = PLAIN,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 shard: ShardPlan | None = None, group: TensorGroup = SOLO, layer: LayerFactory = DecoderLayer) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = config
        self.matmul = matmul
        self.shard = shard or ShardPlan.whole(config)  # what this rank holds (everything in a group of one)
        self.group = group
        self.max_positions = max_positions or config.max_position_embeddings
        self.model = DecoderStack(config, matmul, self.shard, group, layer, **factory)
        self.lm_head = None  # tied: the LM head is the embedding matrix
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, self.shard.vocab_size, False, matmul, **factory)
        self.lm_head_packed = PackedWeight(matmul)
        self.register_buffer("rope_cos", torch.empty(self.max_positions, config.head_dim, **factory), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.max_positions, config.head_dim, **factory), persistent=False)
        # the sliding layers' own table (rope_index 1), where the config gives them a RoPE base of their own
        self.local_rope = any(layer.self_attn.rope_index for layer in self.model.layers)
        if self.local_rope:
            self.register_buffer("rope_cos_local", torch.empty_like(self.rope_cos), persistent=False)
            self.register_buffer("rope_sin_local", torch.empty_like(self.rope_sin), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the RoPE tables in float32, stored in the model's dtype (after `to_empty`)."""
        for local, cos_buf, sin_buf in self._rope_buffers():
            cos, sin = rope_tables(self.config, self.max_positions, local=local)
            cos_buf.copy_(cos)
            sin_buf.copy_(sin)

    def _rope_buffers(self) -> list[tuple[bool, Tensor, Tensor]]:
        tables = [(False, self.rope_cos, self.rope_sin)]
        return tables + [(True, self.rope_cos_local, self.rope_sin_local)] if self.local_rope else tables

    def _rope_rows(self, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(cos, sin) [n, D] of each RoPE table at `positions`, by a layer's `rope_index`."""
        return [(cos[positions], sin[positions]) for _, cos, sin in self._rope_buffers()]

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, H]: the lookup, scaled where the family scales it (Gemma's sqrt(H))."""
        h = self.model.embed_tokens(input_ids)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h.mul_(torch.tensor(m, dtype=h.dtype))

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def packs(self) -> list[tuple[PackedWeight, Tensor]]:
        """Every product's (PackedWeight, weight): the linear layers', then the LM head's."""
        # an untied LM head multiplies through lm_head_packed, not through its Linear
        packs = [(m.packed, m.weight) for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]
        return packs + [(self.lm_head_packed, self.lm_head_weight)]

    def pack_weights(self, release: bool = False) -> None:
        """Reorder every matmul weight into the kernel's layout once.

        A copy: with `release` the plain weights of the linear layers are freed (not the embedding,
        which a tied LM head shares and the lookup reads), so packing costs no extra memory.
        """
        for packed, weight in self.packs():
            packed.pack(weight, release=release and packed is not self.lm_head_packed)

    def matmul_bytes(self) -> int:
        """Bytes of matmul weights one forward reads, in the layout they are multiplied in."""
        return sum(packed.nbytes(weight) for packed, weight in self.packs())

    def unpack_weights(self) -> None:
        """Drop the reordered copies; products read the plain weights again."""
        for packed, _ in self.packs():
            packed.clear()

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: StepContext) -> Tensor:
        """input_ids, positions: [Tp] -> final-normed hidden states [Tp, H]."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        assert len(ctx.kv_caches) == len(self.model.layers)
        ropes = self._rope_rows(positions[: ctx.num_tokens])  # per table, cos and sin [n, D]
        h = self.embed(input_ids)  # [Tp, H]
        for layer, kv_cache in zip(self.model.layers, ctx.kv_caches):
            h = layer(h, *ropes[layer.self_attn.rope_index], kv_cache, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden: [S, H] (the rows that sample) -> logits [S, V] in float32 (on rank 0; None on the others)."""
        # the LM head may run on its own kernel (a float head over int4 layers): lm_head_packed's
        logits = self.lm_head_packed.product(hidden, self.lm_head_weight, None)
        if cap := self.config.final_logit_softcapping:  # c * tanh(logits / c), row by row
            logits = torch.tanh(logits.float() / cap).mul_(cap)
        return self.group.gather_first(logits.float(), list(self.shard.vocab_sizes))

    def reference_forward(self, input_ids: Tensor) -> Tensor:
        """Dense, unpaged forward of one sequence: input_ids [T] -> logits [T, V] (the test oracle)."""
        ropes = self._rope_rows(torch.arange(input_ids.shape[0], device=input_ids.device))
        h = self.embed(input_ids)
        for layer in self.model.layers:
            h = layer.forward_dense(h, *ropes[layer.self_attn.rope_index])
        return self.compute_logits(self.model.norm(h))

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight from a seeded normal (norms get 1 + noise): for tests and benchmarks."""
        self.unpack_weights()  # the packs would be stale (writes through .data keep the version)
        gens: dict[torch.device, torch.Generator] = {}
        for name, p in sorted(self.named_parameters()):
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std
            one = 1.0 - self.config.norm_offset  # a norm's effective weight is 1 + noise
            p.data.copy_(one + noise if name.endswith("norm.weight") else noise)


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                max_positions: int | None = None, matmul: MatmulKernel | str | None = None,
                shard: ShardPlan | None = None, group: TensorGroup = SOLO, layer: LayerFactory = DecoderLayer) -> Transformer:
    """A Transformer with uninitialised weights allocated directly on `device` (fill with load_weights).

    `matmul` defaults to `select_matmul(device, dtype)`; a name picks one of the kernels.
    `shard` and `group`: this rank's part of a tensor-parallel model (default: all of it, alone).
    `layer`: the decoder layer a family builds (default: the pre-norm Llama layer); the families'
    plugins call this with theirs (pagoda/model/families/).
    On a CPU with native bfloat16 products, bfloat16 means bfloat16 weights (`onednn_bf16`, packed by
    the runner) and a float32 model around them: the CPU's elementwise ops and attention are slower in
    bfloat16 than in float32, and float32 activations, norms and KV cache keep the rounding to the weights.
    """
    if not isinstance(matmul, MatmulKernel):
        matmul = select_matmul(device, dtype, matmul)
    if matmul is ONEDNN_BF16:
        dtype = torch.float32  # the kernel holds the bfloat16 copy of each weight
    model = Transformer(config, max_positions, matmul=matmul, dtype=dtype, device="meta", shard=shard, group=group,
                        layer=layer)
    model.to_empty(device=device)
    model.init_rope()
    return model.eval().requires_grad_(False)
