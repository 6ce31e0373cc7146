"""Gemma 3 (the text model, `Gemma3ForCausalLM` / `gemma3_text`): a decoder of its own layer.

As transformers' Gemma3ForCausalLM, in pagoda's parts (pagoda.model.llama):
- the embedding lookup scaled by sqrt(hidden_size), rounded to the weights' dtype;
- (1 + w) RMSNorms everywhere (`norm_offset` 1: checkpoints store w), q and k heads included;
- scores scaled by `query_pre_attn_scalar ** -0.5`, not head_dim's; GeGLU (`gelu_pytorch_tanh`);
- four norms per layer (`Gemma3DecoderLayer`): the attention's output and the MLP's are normed again
  before their residual adds;
- interleaved sliding-window and full layers (`layer_types`; older configs: every `sliding_window_pattern`th
  layer is full), each kind with its RoPE: the full layers' `rope_parameters["full_attention"]` (possibly
  `linear` scaling, as Gemma 3 4B+), the sliding layers' `rope_parameters["sliding_attention"]` theta
  (older: `rope_local_base_freq`), unscaled;
- the logits soft-capped where `final_logit_softcapping` is set (null in the released models).
  `attn_logit_softcapping` is ignored, as transformers' Gemma 3 ignores it (its attention never
  passes the cap on; Gemma 2's did, and Gemma 3's q/k norms replaced it): a checkpoint's numbers were made
  without it. It is null in every released Gemma 3.
A field a config leaves out takes Gemma3TextConfig's default (tied embeddings, head_dim 256, ...).

Refused: `use_bidirectional_attention`, scaled RoPE on the sliding layers, and the multimodal
Gemma3ForConditionalGeneration (not registered: the registry names it as unsupported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from pagoda.distributed.group import TensorGroup
from pagoda.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, ModelConfigError, common_fields
from pagoda.model.gguf_layout import GEMMA3_GGUF
from pagoda.model.llama import MLP, Attention, RMSNorm, StepContext, Transformer, build_model
from pagoda.model.matmul import MatmulKernel
from pagoda.model.shard import ShardPlan
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture

# transformers' Gemma3TextConfig defaults, for the fields a config.json may leave out (the model's size
# itself, vocab_size to num_attention_heads, stays required)
DEFAULTS: dict[str, Any] = dict(
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, query_pre_attn_scalar=256, sliding_window=4096,
)
DEFAULT_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}
DEFAULT_PATTERN = 6  # older configs: every 6th layer is a full one


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Gemma 3 text config.json (transformers 5's spelling, or the older one Gemma 3 was released with)."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("field 'use_bidirectional_attention' = true: only causal attention is supported")
    fields = {**DEFAULTS, **raw}
    layers = int(fields.get("num_hidden_layers") or 0)
    types = fields.get("layer_types") or _pattern_types(fields, layers)
    if SLIDING_ATTENTION in types and not isinstance(fields["sliding_window"], int):
        raise ModelConfigError(f"field 'sliding_window' = {fields['sliding_window']!r}: layer_types has "
                               "sliding_attention layers, so it must be a positive integer")
    full, local = _rope(fields)
    # common_fields reads the full layers' RoPE, GeGLU from `hidden_activation` (the field Gemma 3 reads)
    fields.update(layer_types=list(types), rope_parameters={FULL_ATTENTION: full}, mlp_bias=False,
                  hidden_act=fields.get("hidden_activation") or "gelu_pytorch_tanh")
    for stale in ("rope_scaling", "rope_theta"):
        fields.pop(stale, None)
    common = common_fields(fields, generation, acts=("gelu_pytorch_tanh",))
    scalar = fields["query_pre_attn_scalar"]
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise ModelConfigError(f"field 'query_pre_attn_scalar' = {scalar!r}: must be a positive number")
    bias = bool(fields.get("attention_bias", False))
    return ModelConfig(
        **{**common, "architecture": "Gemma3ForCausalLM"}, family="gemma3",
        qk_norm=True, qkv_bias=bias, o_proj_bias=bias, norm_offset=1.0,
        embedding_multiplier=float(common["hidden_size"]) ** 0.5,
        attention_scale=float(scalar) ** -0.5,
        rope_local_theta=float(local["rope_theta"]),
        attn_logit_softcapping=0.0,  # transformers' Gemma3Attention never applies it (the docstring)
        final_logit_softcapping=float(fields.get("final_logit_softcapping") or 0.0),
    )


def _pattern_types(fields: Mapping[str, Any], layers: int) -> list[str]:
    """An older config's layer kinds: every `sliding_window_pattern`th layer full, the rest sliding."""
    name = next((n for n in ("sliding_window_pattern", "_sliding_window_pattern") if fields.get(n) is not None), None)
    pattern = fields[name] if name else DEFAULT_PATTERN
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ModelConfigError(f"field {name!r} = {pattern!r}: must be a positive integer")
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]


def _rope(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full and the sliding layers' RoPE parameters, as Gemma3TextConfig settles them (either spelling)."""
    params = fields.get("rope_parameters")
    if params and not {FULL_ATTENTION, SLIDING_ATTENTION} & set(params):
        raise ModelConfigError("field 'rope_parameters' must be given per layer type "
                               f"({FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}) for Gemma 3")
    params = params or {}
    full = dict(params.get(FULL_ATTENTION) or {"rope_type": "default"})
    local = dict(params.get(SLIDING_ATTENTION) or {"rope_type": "default"})
    if fields.get("rope_scaling"):
        full.update(fields["rope_scaling"])
    full.setdefault("rope_theta", fields.get("rope_theta") or DEFAULT_THETA[FULL_ATTENTION])
    local.setdefault("rope_theta", fields.get("rope_local_base_freq") or DEFAULT_THETA[SLIDING_ATTENTION])
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise ModelConfigError(f"field 'rope_parameters.{SLIDING_ATTENTION}.rope_type' = {kind!r}: "
                               "the sliding layers' RoPE must be the default, unscaled one")
    return full, local


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's layer, with HF's names: h = x + post_attention_layernorm(attention(input_layernorm(x))),
    then h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""

    def __init__(self, config: ModelConfig, index: int, matmul: MatmulKernel, shard: ShardPlan, group: TensorGroup,
                 **factory: Any) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)

        self.input_layernorm = norm()
        self.self_attn = Attention(config, index, matmul, shard, group, **factory)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(config, matmul, shard, group, **factory)
        self.post_feedforward_layernorm = norm()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], ctx: StepContext) -> Tensor:
        # the residual adds land in the norms' fresh outputs (a + x is x + a, bit for bit)
        a = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, ctx)
        h = self.post_attention_layernorm(a).add_(x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), ctx.threads)).add_(h)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The layer over one whole sequence x [T, H] with plain attention (the test oracle)."""
        h = x + self.post_attention_layernorm(self.self_attn.forward_dense(self.input_layernorm(x), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def build(config: ModelConfig, **options: Any) -> Transformer:
    """The Gemma 3 decoder (options: as pagoda.model.llama.build_model's)."""
    return build_model(config, layer=Gemma3DecoderLayer, **options)


GEMMA3 = Architecture(name="gemma3", hf_architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",),
                      parse_config=parse_config, build=build, gguf=(GEMMA3_GGUF,),
                      description="Gemma 3 text: (1+w) norms, 4 norms a layer, GeGLU, interleaved sliding windows")


@hookimpl
def pagoda_register_architectures(register):
    register(GEMMA3)
