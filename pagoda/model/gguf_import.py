"""Import a GGUF file into a Hugging Face model directory.

The loader has one real format, the Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json). A GGUF file is
turned into one such directory once, so every model loads through one path.

This module knows GGUF as a container; what depends on the architecture (the
config keys, the tensor names, llama.cpp's Q/K row order) is a `GgufLayout`
(`gguf_layout.py`), chosen by the file's `general.architecture`. What differs
between the two formats for the same weights:
- GGUF lists a shape fastest dimension first; torch wants [out, in].
- The architecture's layout may reorder rows (llama: attn_q / attn_k back from
  llama.cpp's adjacent-pairs RoPE order) or fix a weight up.
- Weights are stored in one of `SUPPORTED_TYPES` (F16, Q8_0, Q4_K, ...); every tensor is
  dequantized to float32 by the gguf library. The Q4_0, Q4_1 and Q8_0 tensors' own blocks are also
  kept, rows in torch order, in `q4_0_blocks.safetensors` / `q4_1_blocks.safetensors` /
  `q8_0_blocks.safetensors`, so the file's own format (`--quantization gguf`, the default for a GGUF on a
  CPU) multiplies the file's blocks as they are, and `--quantization int4` packs its 4-bit weights without
  rounding them again.
  A tensor of any other type is refused by name before anything is written.

The output is written to a temporary sibling directory and renamed into place,
so an interrupted import never leaves a directory that later loads. The float32
weights are written in shards of at most `SHARD_BYTES` (with an index when there
are several), so the import holds one shard in memory, not the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pagoda.model.gguf_layout import GgufLayout
from pagoda.model.gguf_vocab import build_tokenizer_files

# Bump when the written directory changes, so older cached imports are redone.
IMPORT_FORMAT_VERSION = 4  # 2: q4_1_blocks.safetensors; 3: layouts, every common type, q4_0 blocks, shards; 4: q8_0
IMPORT_MARKER = "pagoda_import.json"
Q4_1_BLOCKS_FILE = "q4_1_blocks.safetensors"  # HF name -> uint8 [out, in/32, 20] (float16 d, float16 m, 16 bytes of q)
Q4_0_BLOCKS_FILE = "q4_0_blocks.safetensors"  # HF name -> uint8 [out, in/32, 18] (float16 d, 16 bytes of q)
Q8_0_BLOCKS_FILE = "q8_0_blocks.safetensors"  # HF name -> uint8 [out, in/32, 34] (float16 d, 32 int8 q)
# GGUF type -> where its blocks are kept
BLOCK_FILES = {"Q4_1": Q4_1_BLOCKS_FILE, "Q4_0": Q4_0_BLOCKS_FILE, "Q8_0": Q8_0_BLOCKS_FILE}
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")  # + the weight files the marker lists
# The tensor types the importer dequantizes (all through gguf.quants.dequantize); any other is refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SHARD_BYTES = 2 << 30  # float32 bytes per model-*.safetensors shard


class ImportedTensor(NamedTuple):
    """One GGUF tensor as the HF directory holds it."""

    name: str  # HF name
    weight: np.ndarray  # float32, torch layout
    blocks: np.ndarray | None  # Q4_0/Q4_1/Q8_0 blocks [out, in/32, bytes] in torch row order, when kept
    block_type: str | None  # "Q4_0" / "Q4_1" / "Q8_0" with blocks


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value of a GGUFReader (a scalar, string or list), or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, (np.generic,)):
        value = value.item()
    return value


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key of a GGUFReader -> its value."""
    return {key: read_field(reader, key) for key in reader.fields}


def select_layout(meta: Mapping[str, Any], layouts: Mapping[str, GgufLayout]) -> GgufLayout:
    """The layout for the file's `general.architecture` (ValueError names it and the supported ones)."""
    arch = meta.get("general.architecture")
    if arch not in layouts:
        raise ValueError(f"GGUF 'general.architecture' = {arch!r} cannot be imported "
                         f"(supported: {', '.join(sorted(layouts))})")
    return layouts[arch]


def check_tensor_types(tensors: Any) -> None:
    """ValueError naming the first tensor whose type is not one of SUPPORTED_TYPES."""
    for tensor in tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which pagoda does not load "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")


def convert_tensor(tensor: Any, layout: GgufLayout, config: Mapping[str, Any]) -> ImportedTensor:
    """One GGUF tensor dequantized to float32 in torch layout, under its HF name (and its blocks)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    name = layout.hf_name(tensor.name)
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))  # GGUF [in, out] -> torch [out, in]
    w = layout.torch_rows(tensor.name, w, config)
    fixed = w if layout.fix_tensor is None else layout.fix_tensor(name, w, config)
    kind = tensor.tensor_type.name
    blocks = None
    if kind in BLOCK_FILES and w.ndim == 2 and fixed is w:  # a fixed-up weight is no longer what its blocks hold
        out = int(tensor.shape[-1])  # GGUF lists [in, out]; a block holds 32 consecutive inputs of one row
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out, -1, GGML_QUANT_SIZES[tensor.tensor_type][1])
        blocks = np.ascontiguousarray(layout.torch_rows(tensor.name, raw, config))  # whole rows move with their blocks
    return ImportedTensor(name, np.ascontiguousarray(fixed, dtype=np.float32), blocks, kind if blocks is not None else None)


class _ShardWriter:
    """Writes float32 tensors into safetensors shards of about `shard_bytes`; one shard is model.safetensors."""

    def __init__(self, directory: Path, shard_bytes: int) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # the names in each written shard
        self.names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self.names:
            raise ValueError(f"two GGUF tensors map to {name!r}")
        self.names.add(name)
        if self.pending and self.pending_bytes + array.nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = array
        self.pending_bytes += array.nbytes

    def close(self) -> list[str]:
        """Finish the shards; returns the weight files written (an index among them when several)."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.rename(self._shard_path(0), self.directory / "model.safetensors")
            return ["model.safetensors"]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.rename(self._shard_path(i), self.directory / name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {t: names[i] for i, shard in enumerate(self.shards) for t in shard}}
        _write_json(self.directory / "model.safetensors.index.json", index)
        return [*names, "model.safetensors.index.json"]

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        save_file(self.pending, str(self._shard_path(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def _shard_path(self, i: int) -> Path:
        return self.directory / f".shard-{i}.safetensors"


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True,
                layouts: Mapping[str, GgufLayout] | None = None) -> Path:
    """Write the HF directory for `gguf_path` at `out_dir` (atomically) and return `out_dir`.

    `layouts` maps `general.architecture` values to their GgufLayout (default: the built-in architecture
    plugins' layouts, `builtin_architectures().gguf_layouts`).
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    if layouts is None:
        from pagoda.model.architectures import builtin_architectures

        layouts = builtin_architectures().gguf_layouts
    layout = select_layout(meta, layouts)
    if (meta.get("split.count") or 1) > 1:
        raise ValueError(f"{gguf_path.name} is part {meta.get('split.no', 0) + 1} of a GGUF split in "
                         f"{meta['split.count']} files; merge it into one file first (llama-gguf-split --merge)")
    check_tensor_types(reader.tensors)
    config = layout.config(meta, {t.name: t for t in reader.tensors})
    # Built before the weights, so a vocabulary pagoda cannot read is refused before the long part.
    tokenizer_meta = {key: value for key, value in meta.items() if key.startswith("tokenizer.")}
    tokenizer, tokenizer_config = build_tokenizer_files(tokenizer_meta, config["max_position_embeddings"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        # One step per tensor, plus writing the weights and the tokenizer.
        bar = tqdm(
            total=len(reader.tensors) + 2, desc=f"Importing {gguf_path.name}", unit="step", file=sys.stderr, disable=not progress
        )
        with bar:
            weights = _ShardWriter(tmp, SHARD_BYTES)
            blocks: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in BLOCK_FILES}
            for tensor in reader.tensors:
                if tensor.name not in layout.ignored:
                    t = convert_tensor(tensor, layout, config)
                    weights.add(t.name, t.weight)
                    if t.block_type is not None:
                        blocks[t.block_type][t.name] = t.blocks
                bar.update()
            weight_files = weights.close()
            for kind, named in blocks.items():
                if named:
                    save_file(named, str(tmp / BLOCK_FILES[kind]), metadata={"format": "pt"})
            del weights, blocks
            bar.update()
            tokenizer.save(str(tmp / "tokenizer.json"))
            bar.update()
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        # Written last: its presence says the directory is complete and which importer made it.
        stat = gguf_path.stat()
        marker = {"format_version": IMPORT_FORMAT_VERSION, "source": gguf_path.name, "source_size": stat.st_size,
                  "architecture": meta.get("general.architecture"), "weights": weight_files}
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
    return all((path / f).is_file() for f in (*REQUIRED_FILES, *marker.get("weights", ())))


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


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
