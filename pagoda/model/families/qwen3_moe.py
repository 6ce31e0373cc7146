"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and a mixture of experts for the MLP.

Attention is Qwen3's (an RMSNorm over each q and k head before RoPE; `attention_bias` puts biases on
q/k/v/o). A layer's MLP is the sparse block where `num_experts > 0`, the layer is not in `mlp_only_layers`
and `(layer + 1) % decoder_sparse_step == 0` (`ModelConfig.moe_layers`); the others are a dense MLP of
`intermediate_size`. As transformers' Qwen3MoeSparseMoeBlock, the sparse block is:

- a router `gate` (H -> E, a `Linear` on the model's kernel, so a row's logits do not depend on the batch),
  softmax in float32, the top `num_experts_per_tok` experts, their weights renormalised to sum to 1 when
  `norm_topk_prob`, then cast to the logits' dtype;
- each chosen expert, an MLP of `moe_intermediate_size` (SwiGLU: `gate_up_proj`, `down_proj`, as a
  checkpoint's `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` load), times its weight, summed.

Experts run batched by expert: one product per expert over the rows routed to it (a Python loop over the
experts a step hits, never over tokens). Batch invariance (pagoda/model/runner.py's design note) holds as
for the dense layers: each expert's group of rows is padded to the kernel's `row_multiple`, so the rows
it gets from a crowd have the bits they have alone; a token's experts come from its own logits (topk is
row-wise); and its k outputs are summed in one fixed order, expert id order (as transformers sums them),
one add per slot, never through an index_add whose order would depend on the other rows. The rows a step
pads with (beyond `StepContext.num_tokens`) are routed to no expert: their output is zero.

On a GPU the same per-expert loop runs (a documented fallback: there is no grouped-GEMM Triton kernel
yet), with one host sync a layer for the experts' row counts.

Not supported: tensor parallelism (the experts are not split over ranks: `ShardPlan.of` refuses a group
larger than one for a model with `num_experts`), shared experts (Qwen2-MoE's `shared_expert_*`, which
Qwen3-MoE has none of) and any other MoE field this module does not read: they are refused by name.
`use_sliding_window` slides every layer, as transformers' Qwen3-MoE does (the released models have it off).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from pagoda.distributed.group import TensorGroup
from pagoda.model.config import ModelConfig, ModelConfigError, common_fields
from pagoda.model.llama import (MLP, SAME_THREADS, Attention, LinearThreads, RMSNorm, StepContext, build_model,
                                gated)
from pagoda.model.matmul import Linear, MatmulKernel
from pagoda.model.shard import ShardPlan
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture

# MoE fields of a Qwen3-MoE config.json this module reads, or that matter only to training
READ_MOE_FIELDS = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"}
TRAINING_MOE_FIELDS = {"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}
MOE_FIELD = re.compile(r"expert|moe|topk|top_k|router|routed|scoring_func|n_group")


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3-MoE config.json; MoE fields it does not handle (shared experts, other routers) are refused."""
    for name, value in raw.items():
        if (MOE_FIELD.search(name) and name not in READ_MOE_FIELDS | TRAINING_MOE_FIELDS
                and value not in (None, False, 0, "", [], {})):
            raise ModelConfigError(f"field {name!r} = {value!r} is not supported by Qwen3-MoE "
                                   "(shared experts and other routing schemes are not implemented)")
    fields = common_fields(raw, generation)
    layers = int(fields["num_hidden_layers"])
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts")) or 0)
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ModelConfigError(f"field 'decoder_sparse_step' = {step!r}: must be a positive integer")
    dense = set(raw.get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    # transformers' Qwen3-MoE slides every layer when use_sliding_window (it has no max_window_layers)
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**{**fields, "architecture": "Qwen3MoeForCausalLM", "sliding_window": int(window or 0),
                          "layer_types": ()},
                       family="qwen3_moe", qk_norm=True, qkv_bias=bias, o_proj_bias=bias,
                       num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                       moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default
                       moe_layers=moe_layers)


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of `moe_intermediate_size`, gate and up stacked in one product."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, **factory: Any) -> None:
        super().__init__()
        self.intermediate_size = config.moe_intermediate_size
        self.activation = config.hidden_act
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, False, matmul, **factory)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, False, matmul, **factory)

    def forward(self, x: Tensor, threads: LinearThreads = SAME_THREADS) -> Tensor:
        return threads.linear(self.down_proj, gated(threads.linear(self.gate_up_proj, x), self.activation))


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts, named as in a checkpoint (`mlp.gate`, `mlp.experts.{e}.*`)."""

    def __init__(self, config: ModelConfig, matmul: MatmulKernel, **factory: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.row_multiple = matmul.row_multiple  # each expert's rows are padded to it (the module's docstring)
        self.gate = Linear(config.hidden_size, self.num_experts, False, matmul, **factory)
        self.experts = nn.ModuleList(Expert(config, matmul, **factory) for _ in range(self.num_experts))

    def route(self, x: Tensor, num_rows: int | None = None,
              threads: LinearThreads = SAME_THREADS) -> tuple[Tensor, Tensor]:
        """x [Tp, H] -> (weights, experts), each [n, top_k] for the first n = num_rows rows, in top-k order.

        The router's product runs over all Tp rows (the row count keeps its logits batch invariant);
        everything after is row by row, the renormalising sum one add per slot."""
        n = x.shape[0] if num_rows is None else num_rows
        logits = threads.linear(self.gate, x)[:n]  # [n, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k], the most probable first
        if self.norm_topk_prob:
            total = weights[:, 0].clone()
            for slot in range(1, self.top_k):
                total.add_(weights[:, slot])
            weights = weights / total.unsqueeze(-1)
        return weights.to(logits.dtype), experts

    def forward(self, x: Tensor, threads: LinearThreads = SAME_THREADS, num_rows: int | None = None) -> Tensor:
        # x: [Tp, H], the first n rows real -> [Tp, H] (the padding rows' output zero)
        n = x.shape[0] if num_rows is None else num_rows
        k, m = self.top_k, self.row_multiple
        weights, experts = self.route(x, n, threads)
        experts, order = experts.sort(dim=-1)  # a token's experts in id order: the order their outputs add up
        weights = weights.gather(-1, order)
        flat = experts.reshape(-1)  # [n*k], token-major: slot j of token t is t*k + j
        counts = torch.bincount(flat, minlength=self.num_experts)  # rows per expert
        padded = (counts + (m - 1)) // m * m  # each expert's rows, padded to the kernel's row multiple
        starts, padded_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
        by_expert = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within each
        grouped = flat[by_expert]
        where = torch.arange(n * k, device=x.device) - starts[grouped] + padded_starts[grouped]  # padded row of each
        sizes = padded.tolist()  # the one host sync: the experts' row counts
        source = torch.zeros(sum(sizes), dtype=torch.int64, device=x.device)  # padding rows read row 0
        source[where] = by_expert // k
        rows = x[source]  # [P, H]: every expert's rows, one group after the other, each padded
        outs, start = [], 0
        for e, size in enumerate(sizes):  # one product per expert the step routes rows to
            if size:
                outs.append(self.experts[e](rows[start:start + size], threads))
                start += size
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [P, H]
        slot_rows = torch.empty_like(where)
        slot_rows[by_expert] = where  # each (token, slot)'s row of `out`
        slots = out[slot_rows].view(n, k, -1).mul_(weights.unsqueeze(-1))  # [n, k, H]
        y = slots[:, 0].clone()
        for slot in range(1, k):
            y.add_(slots[:, slot])  # one add per slot, in the token's expert id order
        if x.shape[0] > n:
            y = torch.cat((y, y.new_zeros(x.shape[0] - n, y.shape[1])))
        return y


class Qwen3MoeDecoderLayer(nn.Module):
    """The pre-norm layer with Qwen3's attention and, in `config.moe_layers`, the sparse block for its MLP."""

    def __init__(self, config: ModelConfig, index: int, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)
        self.self_attn = Attention(config, index, matmul, shard, group, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)
        self.sparse = index in config.moe_layers
        self.mlp = SparseMoeBlock(config, matmul, **factory) if self.sparse else MLP(config, matmul, shard, group,
                                                                                      **factory)

    def _mlp(self, x: Tensor, threads: LinearThreads, num_rows: int | None) -> Tensor:
        return self.mlp(x, threads, num_rows) if self.sparse else self.mlp(x, threads)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, ctx).add_(x)
        return self._mlp(self.post_attention_layernorm(h), ctx.threads, ctx.num_tokens).add_(h)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The layer over one whole sequence x [T, H] with plain attention (the test oracle)."""
        h = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin)
        return h + self._mlp(self.post_attention_layernorm(h), SAME_THREADS, None)


def build(config: ModelConfig, **options: Any) -> Any:
    """The Transformer of Qwen3-MoE decoder layers (options: as pagoda.model.llama.build_model's)."""
    return build_model(config, **options, layer=Qwen3MoeDecoderLayer)


QWEN3_MOE = Architecture(name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
                         parse_config=parse_config, build=build,
                         description="Qwen3-MoE: Qwen3 attention, top-k routed experts (batched by expert)")


@hookimpl
def pagoda_register_architectures(register):
    register(QWEN3_MOE)
