"""Llama (1, 2, 3.x; SmolLM): the pre-norm decoder as pagoda.model.llama builds it.

`attention_bias` puts biases on q/k/v/o, `mlp_bias` on the MLP; RoPE may be scaled (`llama3`, `linear`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.model.config import ModelConfig, ModelConfigError, common_fields
from pagoda.model.gguf_layout import LLAMA_GGUF
from pagoda.model.llama import build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Llama config.json; a sliding window is refused (Llama has none: the config is not a Llama's)."""
    fields = common_fields(raw, generation)
    if fields["sliding_window"]:
        raise ModelConfigError(f"field 'sliding_window' = {fields['sliding_window']}: a Llama has no sliding window")
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**{**fields, "architecture": "LlamaForCausalLM"}, family="llama", qkv_bias=bias, o_proj_bias=bias)


LLAMA = Architecture(name="llama", hf_architectures=("LlamaForCausalLM",), model_types=("llama",),
                     parse_config=parse_config, build=build_model, gguf=(LLAMA_GGUF,),
                     description="Llama 1/2/3.x, SmolLM: pre-norm, SwiGLU, GQA; llama3/linear RoPE scaling")


@hookimpl
def pagoda_register_architectures(register):
    register(LLAMA)
