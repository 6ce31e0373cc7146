"""What an architecture plugin registers: a model family pagoda can load and run.

An `Architecture` names the configs it serves (`config.json`'s `architectures[0]`, or its `model_type`,
and a GGUF file's `general.architecture`) and carries four functions, all the model room calls:

    parse_config(raw, generation)    config.json (and generation_config.json) as dicts -> a ModelConfig
                                     (pagoda.model.config); a config it cannot run is a ModelConfigError
                                     naming the field
    build(config, **options)         the module, built from pagoda's layers and attention kernels
                                     (pagoda.model.llama's `Transformer` and its parts); options are
                                     matmul, dtype, device, max_positions, shard and group, as
                                     pagoda.model.llama.build_model takes them
    checkpoint_names(name, config)   one checkpoint tensor -> the HF Llama-style names it holds and the
                                     rows each takes, [(name, (start, end) | None)]: how fused tensors
                                     (Phi-3's qkv_proj) are read; None keeps every name as it is
    gguf                             GGUF layouts (pagoda.model.gguf_layout.GgufLayout), by the
                                     `general.architecture` they import

Built-in families (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, Qwen3-MoE) are plugins registered exactly
as a third-party package's: `pagoda_register_architectures(register)` in a module listed in
BUILTIN_PLUGINS. The types here are plain (`Any` where a model-room type goes), so the plugin interface
imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

CheckpointNames = Callable[[str, Any], list[tuple[str, tuple[int, int] | None]]]


@dataclass(frozen=True)
class Architecture:
    """One model family: the configs it serves and how pagoda reads, builds and loads it."""

    name: str  # unique across plugins: what `pagoda plugins` and the model card show ("qwen3")
    hf_architectures: tuple[str, ...]  # config.json `architectures[0]` values ("Qwen3ForCausalLM",)
    parse_config: Callable[[Mapping[str, Any], Mapping[str, Any]], Any]  # -> pagoda.model.config.ModelConfig
    build: Callable[..., Any]  # (config, **options) -> pagoda.model.llama.Transformer
    model_types: tuple[str, ...] = ()  # config.json `model_type` values, when `architectures` is absent
    checkpoint_names: CheckpointNames | None = None  # None: every checkpoint name is already the model's
    gguf: tuple[Any, ...] = field(default=())  # GgufLayouts, one per GGUF `general.architecture` it imports
    description: str = ""  # one line for `pagoda plugins` and docs

    def __post_init__(self) -> None:
        if not self.name or not self.hf_architectures:
            raise ValueError("an Architecture needs a name and at least one hf_architectures entry")
