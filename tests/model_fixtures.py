"""Session fixtures for tests that need the default model (imported once per session).

The import goes through the real path (`resolve_model("default")`). With
$PAGODA_HOME set, its cache is reused across sessions; otherwise a session
temporary directory is used, so a test run never writes to the user's cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagoda.model.hub import SMOLLM2_135M_INSTRUCT, find_embedded_gguf, resolve_model


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Hugging Face directory of the default model, imported at most once per session."""
    home = None if os.environ.get("PAGODA_HOME") else tmp_path_factory.mktemp("pagoda_home")
    return resolve_model("default", home=home, progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):
    """pagoda's Tokenizer for the default model."""
    from pagoda.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The embedded GGUF file of the default model."""
    return find_embedded_gguf(SMOLLM2_135M_INSTRUCT)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path: Path):
    """transformers' own tokenizer built from the GGUF file: an independent oracle."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)
