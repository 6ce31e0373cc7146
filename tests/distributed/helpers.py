"""A tensor-parallel group for the tests: this process is rank 0, the other ranks are spawned, as by `pagoda serve`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pagoda.model.factory import EngineOptions
from pagoda.model.ranks import sharded_model


@contextmanager
def tp_model(model_dir: Path, size: int = 2, **options: Any):
    """Rank 0's shard of the model in `model_dir` and its `Ranks`, the other ranks holding theirs; (model, ranks).

    `options` are EngineOptions fields (cpu, float32 and no quantization by default: the exact path), the same
    for every rank."""
    engine_options = EngineOptions(**{"model": str(model_dir), "device": "cpu", "dtype": "float32",
                                      "quantization": "none", "tensor_parallel_size": size, **options})
    with sharded_model(model_dir, engine_options) as (model, ranks):
        yield model, ranks


def save_model_dir(model: Any, out: Path) -> Path:
    """Write a built (whole) model as a Hugging Face directory: config.json and model.safetensors."""
    import json

    from safetensors.torch import save_file

    from pagoda.model.loader import hf_names

    c = model.config
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": [c.architecture], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "eos_token_id": list(c.eos_token_ids), "torch_dtype": "float32"}))
    sizes = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size, "gate_proj": c.intermediate_size,
             "up_proj": c.intermediate_size}
    tensors = {}
    for name, param in model.named_parameters():
        names = hf_names(name)
        if len(names) == 1:
            tensors[name] = param.detach().clone()
            continue
        parts = param.detach().split([sizes[n.rsplit(".", 2)[1]] for n in names])
        tensors |= {n: p.clone() for n, p in zip(names, parts)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    """The tiny server of tests/server_fixtures.py (the same model and engine), served by two ranks over gloo.

    Imported by a module that collects a single-process module's tests again, it replaces their server."""
    from tests.server_fixtures import TINY_ENGINE, TINY_NAME, start_server

    live = start_server(tiny_model_dir, TINY_NAME, tensor_parallel_size=2, **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def test_the_server_runs_on_two_ranks(tiny_server):
    """Collected by each module that imports it: its server really is a group of two."""
    import httpx

    group = httpx.get(tiny_server.url + "/health", timeout=60).json()["tensor_parallel"]
    assert group["size"] == 2 and group["backend"] == "gloo" and len(group["pids"]) == 2
