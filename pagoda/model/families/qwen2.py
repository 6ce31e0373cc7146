"""Qwen2 (and Qwen2.5): the Llama decoder with biases on q/k/v (not o), and optional sliding-window layers.

`use_sliding_window` makes the layers from `max_window_layers` on slide (transformers 5 writes it as
`layer_types`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.model.config import ModelConfig, common_fields
from pagoda.model.gguf_layout import QWEN2_GGUF
from pagoda.model.llama import build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Qwen2 config.json."""
    fields = common_fields(raw, generation)
    return ModelConfig(**{**fields, "architecture": "Qwen2ForCausalLM"}, family="qwen2", qkv_bias=True)


QWEN2 = Architecture(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), model_types=("qwen2",),
                     parse_config=parse_config, build=build_model, gguf=(QWEN2_GGUF,),
                     description="Qwen2/2.5: the Llama decoder with q/k/v biases")


@hookimpl
def pagoda_register_architectures(register):
    register(QWEN2)
