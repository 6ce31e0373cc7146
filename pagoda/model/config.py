"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

One dataclass covers Llama (1, 2, 3.x), Mistral without a sliding window and
Qwen2 (which adds biases on q/k/v). Sizes used by tests and benchmarks are
kept as data in `NAMED_CONFIGS`, so random-weight models of a realistic shape
need no download.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class ModelConfigError(ValueError):
    """A config.json that pagoda cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE stretch (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
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
    architecture: str = "LlamaForCausalLM"

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
        _require(self.architecture in SUPPORTED_ARCHITECTURES, "architecture",
                 f"{self.architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (the embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json", generation: dict[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed JSON of an HF config (and optionally generation_config.json)."""
        try:
            return _parse(raw, generation or {})
        except (ValueError, TypeError) as exc:  # ModelConfigError is a ValueError
            raise ModelConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (a file, or the model directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
        generation_path = path.parent / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dict(raw, str(path), generation)


def _parse(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 nests theta and scaling here
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if architecture == "MistralForCausalLM":
        window = raw.get("sliding_window")
        if window is not None and window < raw.get("max_position_embeddings", 0):
            raise ModelConfigError(f"field 'sliding_window' = {window}: sliding-window attention is not supported")
    if raw.get("use_sliding_window"):
        raise ModelConfigError("field 'use_sliding_window' = true: sliding-window attention is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"field 'hidden_act' = {raw['hidden_act']!r}: only 'silu' is supported")
    qwen = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    fields = dict(
        vocab_size=_field(raw, "vocab_size"),
        hidden_size=_field(raw, "hidden_size"),
        intermediate_size=_field(raw, "intermediate_size"),
        num_hidden_layers=_field(raw, "num_hidden_layers"),
        num_attention_heads=_field(raw, "num_attention_heads"),
        num_key_value_heads=raw.get("num_key_value_heads") or _field(raw, "num_attention_heads"),
        head_dim=raw.get("head_dim") or 0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=_rope_scaling(scaling),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qwen or attention_bias,
        o_proj_bias=attention_bias and not qwen,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")) + _eos_ids(generation.get("eos_token_id")),
        architecture=architecture,
    )
    fields["eos_token_ids"] = tuple(dict.fromkeys(fields["eos_token_ids"]))  # dedupe, keep order
    return ModelConfig(**fields)


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures")
    if names:
        if not isinstance(names, list) or names[0] not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(f"field 'architectures' = {names!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        return names[0]
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ModelConfigError(f"field 'architectures' is missing and 'model_type' = {model_type!r} is not supported "
                               f"(supported: {', '.join(_MODEL_TYPES)})")
    return _MODEL_TYPES[model_type]


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelConfigError(f"field 'rope_scaling' has type {kind!r}; only 'llama3' is supported")
    try:
        return RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelConfigError(f"field 'rope_scaling' of type 'llama3' is missing {exc.args[0]!r}") from None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _field(raw: dict[str, Any], name: str) -> Any:
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
