"""Live servers for the API tests: real uvicorn on a real socket (127.0.0.1, a port the kernel picks).

`tiny_server` (module scope) serves a random-weight Llama of the tiny shape
with the default model's tokenizer: every code path of the real model, at a
few milliseconds a step. `default_server` (module scope) serves the default
model itself. Both run in this process on a background thread, so a test can
hold the Engine it audits while sockets, HTTP parsing and disconnects are real.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from pagoda.harness.live_server import LiveServer, start_server  # noqa: F401  (re-exported for tests)
from pagoda.model.config import named_config
from tests.model_fixtures import default_model_dir  # noqa: F401  (a fixture used below)

TINY_NAME = "tiny-random"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_llama_config(model_dir: Path, c) -> None:
    """A Llama's config.json in Hugging Face's names, from a ModelConfig `c`."""
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }))


def write_tiny_model_dir(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Hugging Face directory: the tiny Llama shape with random weights and `tokenizer_dir`'s tokenizer."""
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    c = named_config("tiny", vocab_size=vocab)
    out.mkdir(parents=True, exist_ok=True)
    write_llama_config(out, c)
    g = torch.Generator().manual_seed(seed)
    h, hd = c.hidden_size, c.head_dim

    def rand(*shape: int) -> torch.Tensor:
        # std 0.5 rather than 0.02: a peaked distribution, so greedy argmaxes are far from ties
        return torch.randn(*shape, generator=g) * 0.5

    # Untied: with a tied head a random model mostly repeats its input token.
    tensors = {"model.embed_tokens.weight": rand(c.vocab_size, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(c.num_attention_heads * hd, h) / h**0.5,
            p + "self_attn.k_proj.weight": rand(c.num_key_value_heads * hd, h) / h**0.5,
            p + "self_attn.v_proj.weight": rand(c.num_key_value_heads * hd, h) / h**0.5,
            p + "self_attn.o_proj.weight": rand(h, c.num_attention_heads * hd) / h**0.5,
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, h) / h**0.5,
            p + "mlp.up_proj.weight": rand(c.intermediate_size, h) / h**0.5,
            p + "mlp.down_proj.weight": rand(h, c.intermediate_size) / c.intermediate_size**0.5,
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny random-weight model as a Hugging Face directory (written once per session)."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), default_model_dir)


# The tiny server's pool: 64 blocks of 16 tokens. Tests that need preemption start their own.
TINY_ENGINE = dict(num_blocks=64, block_size=16, max_running=8, max_batched_tokens=256, max_model_len=1024)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path):
    """One live server on the tiny model for a whole test module."""
    live = start_server(tiny_model_dir, TINY_NAME, **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


@pytest.fixture(scope="module")
def default_server(default_model_dir: Path):  # noqa: F811
    """One live server on the default model for a whole test module."""
    live = start_server(default_model_dir, "smollm2", num_blocks=128, block_size=16, max_running=8,
                        max_batched_tokens=256, max_model_len=2048)
    try:
        yield live
    finally:
        live.server.stop()
