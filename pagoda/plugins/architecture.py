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
as a third-party package's: `pagoda_register_architectures(register)` in a module of pagoda/model/families/,
named in pagoda.plugins.manager.BUILTIN_ARCHITECTURES.

The plugin interface imports no torch and nothing of the model room, so it types what a family works in by
what it and the model room's registry read of it: a config is a `FamilyConfig` (pagoda.model.config.ModelConfig
is one), a GGUF layout a `GgufLayoutSpec` (pagoda.model.gguf_layout.GgufLayout is one). `Architecture` is
generic in the config its family parses and the module it builds, so that a family's four functions are checked
against one another: pagoda's own families are `Architecture[ModelConfig, Transformer]`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


class FamilyConfig(Protocol):
    """A parsed config as the registry reads one (pagoda.model.config.ModelConfig): which family serves it."""

    @property
    def family(self) -> str: ...  # the name of the Architecture that parsed it and builds its module


class GgufLayoutSpec(Protocol):
    """A GGUF layout as the registry reads one (pagoda.model.gguf_layout.GgufLayout): the files it imports."""

    @property
    def architectures(self) -> tuple[str, ...]: ...  # the `general.architecture` values it reads


ConfigT = TypeVar("ConfigT", bound=FamilyConfig)  # the config a family parses (pagoda's: ModelConfig)
ModuleT = TypeVar("ModuleT")  # the module a family builds (pagoda's: pagoda.model.llama.Transformer)
JsonObject = Mapping[str, Any]  # a parsed JSON object: config.json, generation_config.json
# (checkpoint tensor name, config) -> [(the model's name, its rows of the tensor, or None for all of it)]
CheckpointNames = Callable[[str, ConfigT], list[tuple[str, tuple[int, int] | None]]]


@dataclass(frozen=True)
class Architecture(Generic[ConfigT, ModuleT]):
    """One model family: the configs it serves and how pagoda reads, builds and loads it."""

    name: str  # unique across plugins: what `pagoda plugins` and the model card show ("qwen3")
    hf_architectures: tuple[str, ...]  # config.json `architectures[0]` values ("Qwen3ForCausalLM",)
    parse_config: Callable[[JsonObject, JsonObject], ConfigT]  # (config.json, generation_config.json) -> config
    build: Callable[..., ModuleT]  # (config, **options) -> module; options as pagoda.model.llama.build_model's
    model_types: tuple[str, ...] = ()  # config.json `model_type` values, when `architectures` is absent
    checkpoint_names: CheckpointNames[ConfigT] | None = None  # None: every checkpoint name is already the model's
    gguf: tuple[GgufLayoutSpec, ...] = field(default=())  # one layout per GGUF `general.architecture` it imports
    description: str = ""  # one line for `pagoda plugins` and docs

    def __post_init__(self) -> None:
        if not self.name or not self.hf_architectures:
            raise ValueError("an Architecture needs a name and at least one hf_architectures entry")
