"""Import a llama-architecture GGUF file into a Hugging Face model directory.

The loader has one real format, the Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json). A GGUF file is
turned into one such directory once, so every model loads through one path.

Three things differ between the two formats for the same weights:
- GGUF lists a shape fastest dimension first; torch wants [out, in].
- llama.cpp's converter reorders the rows of attn_q / attn_k inside each head
  for its "adjacent pairs" RoPE. HF Llama rotates halves, so the rows are put
  back (see `unpermute_rows`); skipping this gives fluent-looking garbage.
- Weights are quantized (Q4_1, Q8_0, ...); they are dequantized to float32. The Q4_1 tensors'
  own blocks are also kept, rows in torch order, in `q4_1_blocks.safetensors`, so
  `--quantization int4` packs the file's 4-bit weights as they are instead of rounding them again.

The output is written to a temporary sibling directory and renamed into place,
so an interrupted import never leaves a directory that later loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pagoda.model.gguf_vocab import build_tokenizer_files

# Bump when the written directory changes, so older cached imports are redone.
IMPORT_FORMAT_VERSION = 2  # 2: q4_1_blocks.safetensors
IMPORT_MARKER = "pagoda_import.json"
Q4_1_BLOCKS_FILE = "q4_1_blocks.safetensors"  # HF name -> uint8 [out, in/32, 20] (float16 d, float16 m, 16 bytes of q)
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor (ValueError for a tensor we do not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent; this file is not supported")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row order (adjacent RoPE pairs) to HF's rotate-half order.

    w: [n_head * head_dim, in] (or [n_head * head_dim] for a bias). Within a head,
    llama.cpp row 2*j + s holds HF row s * head_dim/2 + j.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    if n_head * head_dim != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    tail = w.shape[1:]
    # [n_head, head_dim/2, 2, *tail] -> [n_head, 2, head_dim/2, *tail]
    return w.reshape(n_head, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(w.shape)


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value of a GGUFReader (a scalar, string or list), or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, (np.generic,)):
        value = value.item()
    return value


def read_llama_config(reader: Any) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the GGUF metadata."""
    arch = read_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only GGUF files of architecture 'llama' can be imported, this one is {arch!r}")
    if read_field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF key 'llama.rope.scaling.type' is set: RoPE scaling is not supported by the importer")

    def need(key: str) -> Any:
        value = read_field(reader, key)
        if value is None:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return value

    hidden = int(need("llama.embedding_length"))
    n_head = int(need("llama.attention.head_count"))
    n_kv = int(read_field(reader, "llama.attention.head_count_kv", n_head))
    head_dim = int(read_field(reader, "llama.attention.key_length", hidden // n_head))
    tokens = need("tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _short_float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(read_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(need("llama.context_length")),
        "vocab_size": int(read_field(reader, "llama.vocab_size", len(tokens))),
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": read_field(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }


def convert_tensor(tensor: Any, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(HF name, float32 array in torch layout) of one GGUF tensor."""
    from gguf.quants import dequantize

    name = hf_tensor_name(tensor.name)
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))  # GGUF [in, out] -> torch [out, in]
    if ".attn_q." in tensor.name:
        w = unpermute_rows(w, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        w = unpermute_rows(w, config["num_key_value_heads"])
    return name, np.ascontiguousarray(w)


def q4_1_blocks(tensor: Any, config: dict[str, Any]) -> tuple[str, np.ndarray] | None:
    """(HF name, Q4_1 blocks [out, in/32, 20] uint8 in torch row order) of a Q4_1 tensor; None for other types."""
    from gguf import GGMLQuantizationType

    if tensor.tensor_type != GGMLQuantizationType.Q4_1:
        return None
    out = int(tensor.shape[-1])  # GGUF lists [in, out]; a block holds 32 consecutive inputs of one row
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(out, -1, 20)
    if ".attn_q." in tensor.name:  # whole rows move, so the blocks follow the weights' row order
        blocks = unpermute_rows(blocks, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        blocks = unpermute_rows(blocks, config["num_key_value_heads"])
    return hf_tensor_name(tensor.name), np.ascontiguousarray(blocks)


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Write the HF directory for `gguf_path` at `out_dir` (atomically) and return `out_dir`."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = GGUFReader(gguf_path)
    config = read_llama_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        # One step per tensor, plus writing the weights and building the tokenizer.
        bar = tqdm(
            total=len(reader.tensors) + 2, desc=f"Importing {gguf_path.name}", unit="step", file=sys.stderr, disable=not progress
        )
        with bar:
            tensors: dict[str, np.ndarray] = {}
            blocks: dict[str, np.ndarray] = {}
            for tensor in reader.tensors:
                name, w = convert_tensor(tensor, config)
                tensors[name] = w
                if (named := q4_1_blocks(tensor, config)) is not None:
                    blocks[named[0]] = named[1]
                bar.update()
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if blocks:
                save_file(blocks, str(tmp / Q4_1_BLOCKS_FILE), metadata={"format": "pt"})
            del tensors, blocks
            bar.update()
            meta = {key: read_field(reader, key) for key in reader.fields if key.startswith("tokenizer.")}
            tokenizer, tokenizer_config = build_tokenizer_files(meta, config["max_position_embeddings"])
            tokenizer.save(str(tmp / "tokenizer.json"))
            bar.update()
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        # Written last: its presence says the directory is complete and which importer made it.
        stat = gguf_path.stat()
        marker = {"format_version": IMPORT_FORMAT_VERSION, "source": gguf_path.name, "source_size": stat.st_size}
        _write_json(tmp / IMPORT_MARKER, marker)
        # mkdtemp makes a private directory; the cache is ordinary user data.
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        _move_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_complete_import(path: Path) -> bool:
    """True when `path` holds a finished import made by this importer version."""
    try:
        marker = json.loads((path / IMPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format_version") != IMPORT_FORMAT_VERSION:
        return False
    return all((path / f).is_file() for f in REQUIRED_FILES)


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`; an old or broken `out_dir` is moved aside first."""
    if out_dir.exists():
        if is_complete_import(out_dir):
            return  # another process finished the same import first; keep theirs
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
        os.rename(out_dir, stale / out_dir.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Lost a race with a concurrent import of the same file: theirs is as good as ours.
        if not is_complete_import(out_dir):
            raise


def _short_float(x: float) -> float:
    """A float32 read from the file as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
