"""Phi-3: the Llama decoder with q/k/v and gate/up fused in the checkpoint (`qkv_proj`, `gate_up_proj`).

pagoda's layers hold those stacked already; `checkpoint_names` says which rows of a fused tensor are q, k
and v (gate and up), so a tensor-parallel rank reads only its heads' rows of it. A `sliding_window`
(Phi-3-mini-4k's 2047) applies to every layer. The long-context variants' `longrope` scaling is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.model.config import ModelConfig, common_fields
from pagoda.model.gguf_layout import PHI3_GGUF
from pagoda.model.llama import build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Phi-3 config.json."""
    return ModelConfig(**{**common_fields(raw, generation), "architecture": "Phi3ForCausalLM"}, family="phi3")


def checkpoint_names(name: str, config: ModelConfig) -> list[tuple[str, tuple[int, int] | None]]:
    """A fused tensor -> its parts' Llama names and rows; any other name as it is."""
    prefix, _, kind = name.rpartition(".")
    if prefix.endswith(".qkv_proj"):
        base, q, kv = prefix.removesuffix(".qkv_proj"), config.q_size, config.kv_size
        return [(f"{base}.q_proj.{kind}", (0, q)), (f"{base}.k_proj.{kind}", (q, q + kv)),
                (f"{base}.v_proj.{kind}", (q + kv, q + 2 * kv))]
    if prefix.endswith(".gate_up_proj"):
        base, inter = prefix.removesuffix(".gate_up_proj"), config.intermediate_size
        return [(f"{base}.gate_proj.{kind}", (0, inter)), (f"{base}.up_proj.{kind}", (inter, 2 * inter))]
    return [(name, None)]


PHI3 = Architecture(name="phi3", hf_architectures=("Phi3ForCausalLM",), model_types=("phi3",),
                    parse_config=parse_config, build=build_model, checkpoint_names=checkpoint_names,
                    gguf=(PHI3_GGUF,),
                    description="Phi-3: the Llama decoder with fused qkv and gate_up checkpoint tensors")


@hookimpl
def pagoda_register_architectures(register):
    register(PHI3)
