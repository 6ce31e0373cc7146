"""OLMo 2 as a pagoda architecture plugin: two overrides of pagoda's layers, registered through an entry point."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from pagoda.model.config import ModelConfig, ModelConfigError, common_fields
from pagoda.model.llama import MLP, Attention, RMSNorm, apply_rope, build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


class Olmo2Attention(Attention):
    """pagoda's attention, with q and k RMS-normed over their whole width (every head at once) before RoPE."""

    def __init__(self, config: ModelConfig, index: int, matmul: Any, shard: Any, group: Any, **factory: Any) -> None:
        super().__init__(config, index, matmul, shard, group, **factory)
        if shard.size > 1:
            raise ModelConfigError("OLMo 2 norms q and k across every head: tensor parallelism is not supported")
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps, **factory)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps, **factory)

    def _qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t = cos.shape[0]
        qkv = qkv[:t]
        q = self.q_norm(qkv[:, : self.q_size].contiguous()).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].contiguous())
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin), v


class Olmo2DecoderLayer(nn.Module):
    """Norms after the sublayers: h = x + norm(attention(x)), then h + norm(mlp(h))."""

    def __init__(self, config: ModelConfig, index: int, matmul: Any, shard: Any, group: Any, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, index, matmul, shard, group, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, matmul, shard, group, **factory)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: Any) -> Tensor:
        h = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, ctx)).add_(x)
        return self.post_feedforward_layernorm(self.mlp(h, ctx.threads)).add_(h)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.post_attention_layernorm(self.self_attn.forward_dense(x, cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(h))


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """An OLMo 2 config.json: Llama's fields (q/k/v/o biases with attention_bias)."""
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**{**common_fields(raw, generation), "architecture": "Olmo2ForCausalLM"}, family="olmo2",
                       qkv_bias=bias, o_proj_bias=bias)


def build(config: ModelConfig, **options: Any) -> Any:
    """pagoda's Transformer with OLMo 2's layers."""
    return build_model(config, layer=Olmo2DecoderLayer, **options)


OLMO2 = Architecture(name="olmo2", hf_architectures=("Olmo2ForCausalLM",), model_types=("olmo2",),
                     parse_config=parse_config, build=build,
                     description="OLMo 2: post-sublayer norms, q/k norms over all heads")


@hookimpl
def pagoda_register_architectures(register):
    register(OLMO2)
