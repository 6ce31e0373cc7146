"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE, and no q/k/v biases.

`attention_bias` (false in the released models) puts biases on q/k/v/o; embeddings may be tied or not;
sliding-window layers as Qwen2's (`layer_types`, or `use_sliding_window` from `max_window_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.model.config import ModelConfig, common_fields
from pagoda.model.gguf_layout import QWEN3_GGUF
from pagoda.model.llama import build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3 config.json."""
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**{**common_fields(raw, generation), "architecture": "Qwen3ForCausalLM"}, family="qwen3",
                       qk_norm=True, qkv_bias=bias, o_proj_bias=bias)


QWEN3 = Architecture(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
                     parse_config=parse_config, build=build_model, gguf=(QWEN3_GGUF,),
                     description="Qwen3: the Llama decoder with per-head q/k RMSNorm")


@hookimpl
def pagoda_register_architectures(register):
    register(QWEN3)
