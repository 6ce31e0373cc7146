"""Load a Hugging Face model directory: config.json plus safetensors weights.

A directory holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensors are read one at a time and copied
straight into parameters already allocated on the target device in the
target dtype, so peak memory is the model plus one tensor.

A tensor-parallel rank reads only its shard of each tensor (`ShardPlan`'s rows or
columns, through safetensors' slices): its own memory is its shard plus one tensor's shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagoda.distributed.group import SOLO, TensorGroup
from pagoda.kernels import cpu_native
from pagoda.model.architectures import Architectures, builtin_architectures, read_config
from pagoda.model.config import ModelConfig
from pagoda.model.gguf_import import BLOCK_FILES
from pagoda.model.llama import Transformer
from pagoda.model.matmul import (
    BLOCKS,
    INT4,
    ONEDNN_BF16,
    Linear,
    PackedWeight,
    has_onednn_bf16,
    quantized_matmul,
    select_matmul,
)
from pagoda.model.quantize import block_weight_from_gguf, int4_from_gguf_blocks
from pagoda.model.shard import ShardPlan
from pagoda.plugins.architecture import CheckpointNames

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The LM head's format under --quantization int8/int4 (it is 21% of the default model's weight bytes).
# int4 rounds the head (the tied embedding, Q8_0 in the GGUF) too coarsely: greedy agreement 0.85 against
# 0.98 with a bfloat16 or int8 head; int8 is as good as bfloat16 and faster (docs/performance.md).
LM_HEAD_FORMATS = ("float", "int8", "int4")  # float: onednn_bf16 where native, else the float32 kernel
DEFAULT_LM_HEAD = {"int8": "int8", "int8_avx2": "int8", "int4": "int8"}  # by the layers' kernel; blocks: the layers'


def resolve_quantization(quantization: str, model_dir: Path, device: torch.device | str) -> str:
    """`auto`: the GGUF's own blocks (`gguf`) for a model imported from a GGUF that kept some, on a CPU where
    pagoda's C++ kernels run; `none` otherwise. Any other value as given."""
    if quantization != "auto":
        return quantization
    gguf = any((Path(model_dir) / name).is_file() for name in BLOCK_FILES.values())
    return "gguf" if gguf and torch.device(device).type == "cpu" and cpu_native.available() else "none"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' is cuda when a GPU is visible, else cpu; 'cuda' without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 (weights) on a CPU that multiplies it natively, else float32 there, and bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # on the CPU bfloat16 is a weight format (onednn_bf16, 1.1-1.5x faster decode); float32 is the exact one
        return torch.bfloat16 if device.type != "cpu" or has_onednn_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in order; FileNotFoundError names what is missing."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight shard {f.name} listed in {index} is missing")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(model_dir.glob("*.bin")) else ""
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}{hint}")


def iter_checkpoint(files: list[Path], shard: ShardPlan | None = None, names: CheckpointNames | None = None,
                    config: ModelConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read lazily on the CPU; with `shard`, only its part.

    `names` (an architecture's `checkpoint_names`) splits a fused tensor into the names it holds, each with
    its rows of the tensor (Phi-3's qkv_proj into q_proj, k_proj and v_proj): what is yielded is always the
    Llama-style names the model's parameters are stacked from."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as reader:
            for stored in reader.keys():
                for name, rows in (names(stored, config) if names else [(stored, None)]):
                    if shard is None or shard.size == 1:
                        tensor = reader.get_tensor(stored) if rows is None else reader.get_slice(stored)[rows[0]:rows[1]]
                        yield name, tensor
                    elif (part := read_shard(reader, name, shard, stored=stored, offset=rows[0] if rows else 0)) is not None:
                        yield name, part


def read_shard(reader: Any, name: str, shard: ShardPlan, *, per: int = 1, stored: str | None = None,
               offset: int = 0) -> torch.Tensor | None:
    """The part of checkpoint tensor `name` that `shard` holds (None: a row-parallel bias another rank adds).

    `per` > 1 reads a blocked tensor whose second axis holds blocks of `per` input columns (Q4_1's 32);
    a column range that does not fall on block bounds is None too (the rank quantizes its shard itself).
    `stored` and `offset`: `name` is the rows from `offset` on of the fused tensor `stored` (Phi-3's)."""
    parts = name.rsplit(".", 2)
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    sliced = reader.get_slice(stored or name)
    if (rows := shard.rows(proj)) is not None:
        return sliced[offset + rows[0]:offset + rows[1]]
    if (cols := shard.columns(proj)) is not None:
        if kind == "bias":
            return sliced[:] if shard.adds_row_bias else None
        if cols[0] % per or cols[1] % per:
            return None
        return sliced[:, cols[0] // per:cols[1] // per]
    if stored is not None and stored != name:
        raise ValueError(f"checkpoint tensor {stored!r}: its part {name!r} cannot be split over ranks")
    return sliced[:]


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    max_positions: int | None = None,
    matmul: str | None = None,
    quantization: str = "none",
    lm_head: str | None = None,
    shard: ShardPlan | None = None,
    group: TensorGroup = SOLO,
    architectures: Architectures | None = None,
) -> tuple[Transformer, ModelConfig]:
    """Load an HF directory into a Transformer on `device` in `dtype` ('auto' picks per device).

    `max_positions` bounds the RoPE table (default: the config's context);
    `matmul` names a MatmulKernel (default: the batch-invariant one for the device, or the quantization's);
    `quantization` int8/int4/gguf/w8a8 is a weight format of the linear layers (the rest of the model is float32;
    `auto`: see resolve_quantization), the LM head in `lm_head` (one of LM_HEAD_FORMATS; default: DEFAULT_LM_HEAD,
    the layers' own for gguf and w8a8);
    `shard` and `group`: one tensor-parallel rank's part of the model, read alone (default: all of it);
    `architectures`: the registry whose plugin parses and builds the model (default: the built-in families).
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    architectures = architectures or builtin_architectures()
    config = read_config(model_dir / "config.json", architectures)
    arch = architectures.of(config)
    files = checkpoint_files(model_dir)
    device = resolve_device(device)
    quantization = resolve_quantization(quantization, model_dir, device)
    kernel = quantized_matmul(quantization, device)
    if kernel is None:
        model = arch.build(config, dtype=resolve_dtype(dtype, device), device=device, max_positions=max_positions,
                           matmul=matmul, shard=shard, group=group)
    else:
        if matmul is not None:  # another kernel of the same format (benchmarks compare them)
            kernel = select_matmul(device, name=matmul)
        model = arch.build(config, dtype=torch.float32, device=device, max_positions=max_positions, matmul=kernel,
                           shard=shard, group=group)
        head = lm_head or DEFAULT_LM_HEAD.get(kernel.name, quantization)
        if head not in (*LM_HEAD_FORMATS, quantization):
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEAD_FORMATS)}, got {head!r}")
        if head == "float":
            model.lm_head_packed = PackedWeight(ONEDNN_BF16 if has_onednn_bf16() else select_matmul(device))
        elif head != quantization and (head_kernel := quantized_matmul(head, device)) is not kernel:
            model.lm_head_packed = PackedWeight(head_kernel)
    try:
        load_weights(model, iter_checkpoint(files, model.shard, arch.checkpoint_names, config))
    except ValueError as exc:
        raise ValueError(f"{model_dir}: {exc}") from None
    if kernel is INT4:
        adopt_gguf_blocks(model, model_dir, INT4, lambda shards, kinds: int4_from_gguf_blocks(shards)
                          if set(kinds) <= {"Q4_0", "Q4_1"} else None)  # Q4_0 and Q4_1 parts may stack
    elif quantization == "gguf":  # one block format a weight: parts of two types are rounded to Q8_0 at packing
        adopt_gguf_blocks(model, model_dir, BLOCKS, lambda shards, kinds: block_weight_from_gguf(
            torch.cat(shards), kinds[0].lower()) if len(set(kinds)) == 1 else None)
    return model, config


def weight_format(model: Transformer) -> str:
    """One line naming how the model multiplies: the layers' kernel and, when it differs, the LM head's."""
    head = model.lm_head_packed.matmul
    return model.matmul.name if head is model.matmul else f"{model.matmul.name} (LM head {head.name})"


def adopt_gguf_blocks(model: Transformer, model_dir: Path, kernel: Any,
                      convert: Callable[[list[torch.Tensor], list[str]], Any]) -> int:
    """Pack the layers of `kernel` from a GGUF import's own blocks (no second rounding); returns how many.

    `convert(shards, gguf_types)` makes the pack from a weight's blocks [out, in/32, bytes] and GGUF types (one
    each per stacked checkpoint tensor), or None for types the format does not take (then rounded from float at
    packing). A
    tied LM head takes the embedding's blocks and leaves the embedding, which the lookup reads, in place."""
    kinds = {path: kind for kind, name in BLOCK_FILES.items() if (path := model_dir / name).is_file()}
    if not kinds:
        return 0
    targets = [(f"{name}.weight", m.packed, m.weight, True) for name, m in model.named_modules()
               if isinstance(m, Linear) and m is not model.lm_head]
    if model.lm_head_packed.matmul is kernel:
        head = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        targets.append((head, model.lm_head_packed, model.lm_head_weight, model.lm_head is not None))
    adopted = 0
    with ExitStack() as stack:
        readers = {path: stack.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in kinds}
        holder = {key: (reader, kinds[path]) for path, reader in readers.items() for key in reader.keys()}
        for name, packed, weight, release in targets:
            parts = hf_names(name)
            if not all(p in holder for p in parts):
                continue  # another GGUF type: rounded from float at packing
            shards = [read_shard(holder[p][0], p, model.shard, per=32) for p in parts]
            if any(b is None for b in shards):
                continue  # this rank's columns split a block: quantized from its float shard at packing
            rows, groups = sum(b.shape[0] for b in shards), shards[0].shape[1]  # [out, in/32, bytes] each, stacked rows
            if rows != weight.shape[0] or any(b.shape[1] != groups for b in shards) or groups * 32 != weight.shape[1]:
                raise ValueError(f"{model_dir}: blocks of {name} have shapes {[tuple(b.shape) for b in shards]}, "
                                 f"weight {tuple(weight.shape)}")
            pack = convert(shards, [holder[p][1] for p in parts])
            if pack is not None:
                packed.adopt(pack, weight, release=release)
                adopted += 1
    return adopted


def load_weights(model: Transformer, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named checkpoint tensors into the model; ValueError names a missing, unknown or misshapen one."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
            continue  # derived from the config / the tied embedding
        target, rows = _stacked_target(model.shard, name, params)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
        dest = params[target].data if rows is None else params[target].data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)  # casts to the model's dtype and device
        loaded.add(name)
    missing = sorted(set(checkpoint_names(model)) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")


def _stacked_target(shard: ShardPlan, name: str, params: dict[str, Any] | None = None) -> tuple[str, slice | None]:
    """Map an HF tensor name to (our parameter, the rows it fills): q/k/v and gate/up are stacked.

    gate and up are the halves of the stacked parameter in `params` where it is there: a dense MLP's part of
    the intermediate size, or an expert's own (Qwen3-MoE's `mlp.experts.{e}`, moe_intermediate_size)."""
    parts = name.rsplit(".", 2)  # [prefix, proj, weight|bias]
    if len(parts) == 3:
        prefix, proj, kind = parts
        q, kv, inter = shard.q_size, shard.kv_size, shard.intermediate_size  # this rank's heads and part
        gate_up = (params or {}).get(f"{prefix}.gate_up_proj.{kind}")
        if proj in ("gate_proj", "up_proj") and gate_up is not None:
            inter = gate_up.shape[0] // 2
        stacked = {
            "q_proj": ("qkv_proj", slice(0, q)),
            "k_proj": ("qkv_proj", slice(q, q + kv)),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "gate_proj": ("gate_up_proj", slice(0, inter)),
            "up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
        }
        if proj in stacked:
            ours, rows = stacked[proj]
            return f"{prefix}.{ours}.{kind}", rows
    return name, None


def checkpoint_names(model: Transformer) -> list[str]:
    """The HF tensor names a checkpoint of this model must hold."""
    return [hf for name, _ in model.named_parameters() for hf in hf_names(name)]


def hf_names(name: str) -> list[str]:
    """The HF tensor names one of our parameters is stacked from (q/k/v, gate/up), else [name]."""
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    prefix, proj, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
    return [f"{prefix}.{p}.{kind}" for p in parts[proj]] if proj in parts else [name]


def context_length(options: Any, model_config: ModelConfig) -> int:
    """Prompt + output tokens of one request: --max-model-len, at most the model's context (its default)."""
    context = model_config.max_position_embeddings
    if options.max_model_len is not None and options.max_model_len > context:
        raise ValueError(f"max_model_len {options.max_model_len} exceeds the model's context of {context} tokens")
    return options.max_model_len or context


def load_shard(model_dir: Path, options: Any, group: TensorGroup = SOLO,
               local_rank: int | None = None) -> Transformer:
    """The part of the model in `model_dir` that `group`'s rank holds (all of it in a group of one); its
    architecture plugin comes from `options.architectures` (EngineOptions': the built-in ones when None)."""
    architectures = options.architectures
    device = resolve_device(options.device)
    if device.type == "cuda" and local_rank is not None:
        device = torch.device("cuda", local_rank)
    model_config = read_config(model_dir, architectures)
    max_positions = context_length(options, model_config)  # refused before any weight loads
    shard = ShardPlan.of(model_config, group.rank, group.size)  # refuses a group larger than the KV heads
    # on CUDA, invariance is a choice of kernels (the CPU proves its own at start-up, pagoda/model/invariance.py)
    invariant_cuda = device.type == "cuda" and options.invariant_on(device) and options.quantization in ("none", "auto")
    model, _ = load_model(model_dir, dtype=resolve_dtype(options.dtype, device), device=device,
                          max_positions=max_positions, quantization=options.quantization, shard=shard, group=group,
                          architectures=architectures, matmul="triton_invariant" if invariant_cuda else None)
    return model
