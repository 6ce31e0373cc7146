"""The architectures a process can load: the registered plugins, looked up by what a config names.

A config.json names its family by `architectures[0]` (or, without it, `model_type`); a GGUF file by
`general.architecture`. `Architectures` finds the plugin (pagoda.plugins.architecture.Architecture)
that serves each. `pagoda serve` and `pagoda generate` pass the registry their plugin manager collected
(built-in and installed plugins, less the disabled ones); everything else (the library, tests,
benchmarks) gets `builtin_architectures()`, the built-in families alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pagoda.model.config import ModelConfig, ModelConfigError
from pagoda.model.gguf_layout import layouts_by_architecture
from pagoda.plugins.architecture import Architecture


class Architectures:
    """Registered architectures by name, HF class name, model_type and GGUF architecture."""

    def __init__(self, archs: Iterable[Architecture]) -> None:
        self.by_name: dict[str, Architecture] = {}
        self.by_class: dict[str, Architecture] = {}
        self.by_model_type: dict[str, Architecture] = {}
        archs = list(archs)
        for arch in archs:
            self.by_name[arch.name] = arch
            self.by_class.update(dict.fromkeys(arch.hf_architectures, arch))
            self.by_model_type.update(dict.fromkeys(arch.model_types, arch))
        # general.architecture -> GgufLayout; a GGUF architecture two plugins claim is an error
        self.gguf_layouts = layouts_by_architecture(*(layout for arch in archs for layout in arch.gguf))

    def for_config(self, raw: Mapping[str, Any]) -> Architecture:
        """The plugin serving a config.json: by `architectures[0]`, else by `model_type`."""
        names = raw.get("architectures")
        if names:
            if not isinstance(names, list) or names[0] not in self.by_class:
                raise ModelConfigError(f"field 'architectures' = {names!r} is not supported "
                                       f"(supported: {', '.join(sorted(self.by_class))})")
            return self.by_class[names[0]]
        model_type = raw.get("model_type")
        if model_type not in self.by_model_type:
            raise ModelConfigError(f"field 'architectures' is missing and 'model_type' = {model_type!r} is not "
                                   f"supported (supported: {', '.join(sorted(self.by_model_type))})")
        return self.by_model_type[model_type]

    def named(self, name: str) -> Architecture:
        """The plugin registered under `name` (a ModelConfig's `family`)."""
        if name not in self.by_name:
            raise ModelConfigError(f"architecture {name!r} is not registered "
                                   f"(registered: {', '.join(sorted(self.by_name))})")
        return self.by_name[name]

    def of(self, config: ModelConfig) -> Architecture:
        return self.named(config.family)


def builtin_architectures() -> Architectures:
    """The built-in families only (no installed plugin, nothing disabled): the library's and tests' default."""
    from pagoda.model.families import register_families
    from pagoda.plugins.manager import ALLOW_ENV, collect_architectures, load_plugins

    return Architectures(collect_architectures(register_families(load_plugins(environ={ALLOW_ENV: "none"}))))


def parse_config(raw: Mapping[str, Any], source: str = "config.json", generation: Mapping[str, Any] | None = None,
                 architectures: Architectures | None = None) -> ModelConfig:
    """A ModelConfig from the parsed JSON of an HF config (and optionally generation_config.json), through the
    architecture plugin that serves it; a config it cannot run is a ModelConfigError starting with `source`."""
    registry = architectures or builtin_architectures()
    try:
        return registry.for_config(raw).parse_config(raw, generation or {})
    except (ValueError, TypeError) as exc:  # ModelConfigError is a ValueError
        raise ModelConfigError(f"{source}: {exc}") from None


def read_config(path: str | Path, architectures: Architectures | None = None) -> ModelConfig:
    """Read `config.json` (a file, or the model directory holding it) and generation_config.json beside it."""
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
    return parse_config(raw, str(path), generation, architectures)


def build_model(config: ModelConfig, architectures: Architectures | None = None, **options: Any) -> Any:
    """The module of `config`'s family, built by its plugin (options: as pagoda.model.llama.build_model's)."""
    return (architectures or builtin_architectures()).of(config).build(config, **options)
