"""The shape of a decoder, read from a Hugging Face `config.json` by its architecture plugin.

One dataclass covers every family pagoda runs: the Llama shape (vocabulary, widths, heads, RoPE), plus the
fields in which families differ from it (q/k norms, Gemma's norm offset and embedding scale, sliding-window
layers, soft-capping, a mixture of experts). Each family's plugin (pagoda/model/families/) parses its
config into it with `common_fields` and its own fields and refusals; `read_config` (pagoda/model/
architectures.py) finds the plugin through the architectures registry. Sizes used by tests and
benchmarks are kept as data in `NAMED_CONFIGS`, so random-weight models of a realistic shape need no
download.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' layer_types
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


class ModelConfigError(ValueError):
    """A config.json that pagoda cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE stretch: Llama 3's frequency-dependent one (`llama3`) or plain position interpolation (`linear`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        _require(self.rope_type in ("llama3", "linear"), "rope_scaling.rope_type",
                 f"{self.rope_type!r} is not supported (supported: llama3, linear)")
        _require(self.factor >= 1, "rope_scaling.factor", f"must be >= 1, got {self.factor}")
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            "rope_scaling.low_freq_factor",
            f"must be > 0 and below high_freq_factor, got {self.low_freq_factor} and {self.high_freq_factor}",
        )
        _require(self.original_max_position_embeddings >= 1, "rope_scaling.original_max_position_embeddings", "must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_proj_bias: bool = False  # Llama with attention_bias only
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"  # config.json's architectures[0]
    family: str = "llama"  # the registered Architecture (plugin) that parses and builds it
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma's 1
    embedding_multiplier: float = 1.0  # the embedding lookup is scaled by it: Gemma's sqrt(hidden_size)
    attention_scale: float = 0.0  # scores are q.k times this; 0 = head_dim ** -0.5
    sliding_window: int = 0  # keys a sliding-window layer sees, itself included (0: none)
    layer_types: tuple[str, ...] = ()  # per layer, full_attention or sliding_attention (() = every layer full)
    rope_local_theta: float = 0.0  # the RoPE base of sliding layers, unscaled (Gemma 3); 0 = as the full layers
    attn_logit_softcapping: float = 0.0  # scores become c * tanh(s / c) (0: none)
    final_logit_softcapping: float = 0.0  # logits likewise
    num_experts: int = 0  # a mixture of experts: experts per MoE layer (0: a dense model)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = True  # the top-k routing weights are renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the mixture of experts

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            _require(ok, name, f"must be a positive integer, got {value!r}")
        if self.head_dim == 0:
            _require(self.hidden_size % self.num_attention_heads == 0, "head_dim",
                     "is absent and hidden_size is not a multiple of num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _require(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", f"must be a positive even integer, got {self.head_dim}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"({self.num_key_value_heads}) must divide num_attention_heads ({self.num_attention_heads})")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.hidden_act in HIDDEN_ACTS, "hidden_act",
                 f"{self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        _require(isinstance(self.sliding_window, int) and self.sliding_window >= 0, "sliding_window",
                 f"must be a non-negative integer, got {self.sliding_window!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                     f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            _require(not unknown, "layer_types", f"holds {sorted(unknown)}: only {FULL_ATTENTION} and {SLIDING_ATTENTION}")
            _require(self.sliding_window > 0 or SLIDING_ATTENTION not in self.layer_types, "sliding_window",
                     "must be set where layer_types has sliding_attention layers")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "attention_scale", "rope_local_theta"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        if self.num_experts:
            _require(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                     f"must be 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}")
            _require(self.moe_intermediate_size >= 1, "moe_intermediate_size", "must be a positive integer")
            _require(all(0 <= i < self.num_hidden_layers for i in self.moe_layers), "moe_layers",
                     f"must be layer indices below {self.num_hidden_layers}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """The keys layer `layer` sees (0: all of them): the sliding window where the layer is a sliding one."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0

    def num_parameters(self) -> int:
        """Parameter count (the embedding counted once when tied; every expert counted)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        moe = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        mlps = sum(moe if layer in self.moe_layers else 3 * h * i for layer in range(self.num_hidden_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * (attn + 2 * h) + mlps + h + head


def common_fields(raw: Mapping[str, Any], generation: Mapping[str, Any], *, acts: tuple[str, ...] = ("silu",)) -> dict[str, Any]:
    """The Llama-shaped fields every family shares, read from config.json (refusing what no family runs).

    RoPE is read in both spellings (`rope_theta` + `rope_scaling`, transformers 4; `rope_parameters`,
    transformers 5); sliding windows from `sliding_window` with `layer_types` (or `use_sliding_window`)."""
    rope = _rope_parameters(raw)
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in acts:
        raise ModelConfigError(f"field 'hidden_act' = {act!r}: only {' or '.join(map(repr, acts))} is supported")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError(f"field 'partial_rotary_factor' = {rope['partial_rotary_factor']}: "
                               "only a rotary embedding over the whole head is supported")
    fields = dict(
        vocab_size=_field(raw, "vocab_size"),
        hidden_size=_field(raw, "hidden_size"),
        intermediate_size=_field(raw, "intermediate_size"),
        num_hidden_layers=_field(raw, "num_hidden_layers"),
        num_attention_heads=_field(raw, "num_attention_heads"),
        num_key_value_heads=raw.get("num_key_value_heads") or _field(raw, "num_attention_heads"),
        head_dim=raw.get("head_dim") or 0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling(rope),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(_eos_ids(raw.get("eos_token_id")) + _eos_ids(generation.get("eos_token_id")))),
        architecture=(raw.get("architectures") or [""])[0],
        hidden_act=act,
    )
    fields.update(sliding_fields(raw, int(fields["num_hidden_layers"])))
    return fields


def sliding_fields(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types: transformers 5 writes layer_types; older configs say use_sliding_window
    (Qwen2/3: the layers from max_window_layers on slide) or, for Mistral, just a sliding_window."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types:
        types = tuple(types)
        if SLIDING_ATTENTION not in types:
            return {"sliding_window": 0, "layer_types": ()}
        return {"sliding_window": int(_field(raw, "sliding_window")), "layer_types": types}
    if "use_sliding_window" in raw:  # the Qwen spelling: off unless asked for
        if not raw["use_sliding_window"] or window is None:
            return {"sliding_window": 0, "layer_types": ()}
        first = int(raw.get("max_window_layers", num_layers))
        return {"sliding_window": int(window),
                "layer_types": tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))}
    if window is None or window >= raw.get("max_position_embeddings", 0):
        return {"sliding_window": 0, "layer_types": ()}  # a window wider than the context slides nowhere
    return {"sliding_window": int(window), "layer_types": ()}


def _rope_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """theta and scaling as one dict, from either transformers' spelling (the full layers' where it has two)."""
    rope = dict(raw.get("rope_parameters") or {})
    if FULL_ATTENTION in rope:  # per layer type (Gemma 3): the full layers'; a family reads the rest
        rope = dict(rope[FULL_ATTENTION] or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
    scaling = raw.get("rope_scaling")
    if scaling and rope.get("rope_type", "default") == "default":
        rope.update(scaling)
    if "partial_rotary_factor" in raw and raw["partial_rotary_factor"] is not None:
        rope["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return rope


def rope_scaling(rope: Mapping[str, Any]) -> RopeScaling | None:
    """The RoPE stretch a `rope_parameters`-like dict asks for (None for the default, unscaled RoPE)."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(factor=float(rope["factor"]), rope_type="linear")
    if kind != "llama3":
        raise ModelConfigError(f"field 'rope_scaling' has type {kind!r}; only 'llama3' and 'linear' are supported")
    try:
        return RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelConfigError(f"field 'rope_scaling' of type 'llama3' is missing {exc.args[0]!r}") from None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _field(raw: Mapping[str, Any], name: str) -> Any:
    if name not in raw:
        raise ModelConfigError(f"required field {name!r} is missing")
    return raw[name]


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


# Sizes as data: "tiny" for fast tests, the rest for random-weight benchmarks of a real shape.
NAMED_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
}


def named_config(name: str, **overrides: Any) -> ModelConfig:
    """A copy of one of `NAMED_CONFIGS`, with fields overridden."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model size {name!r} (known: {', '.join(NAMED_CONFIGS)})")
    return replace(NAMED_CONFIGS[name], **overrides)
