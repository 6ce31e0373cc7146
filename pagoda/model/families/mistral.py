"""Mistral: the Llama decoder with a sliding window over every layer (`sliding_window`).

The window is the kernels' (pagoda/kernels: a query sees its last `sliding_window` keys); the ledger
keeps every block of a sequence (docs/models.md says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.model.config import ModelConfig, common_fields
from pagoda.model.llama import build_model
from pagoda.plugins import hookimpl
from pagoda.plugins.architecture import Architecture


def parse_config(raw: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelConfig:
    """A Mistral config.json: Llama's fields, and the window (null, or wider than the context: none)."""
    return ModelConfig(**{**common_fields(raw, generation), "architecture": "MistralForCausalLM"}, family="mistral")


MISTRAL = Architecture(name="mistral", hf_architectures=("MistralForCausalLM",), model_types=("mistral",),
                       parse_config=parse_config, build=build_model,
                       description="Mistral: the Llama decoder with sliding-window attention")


@hookimpl
def pagoda_register_architectures(register):
    register(MISTRAL)
