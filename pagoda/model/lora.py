"""LoRA adapters over the served model: PEFT directories read and checked, and each row's delta added in a step.

Design note.
- What is read. A PEFT LoRA directory: `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
  `...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and `lora_B.weight` [out, r]. The projections a
  family's decoder has may be adapted: q, k, v, o, gate, up, down, and Phi-3's fused qkv and gate_up. Anything
  else (DoRA, embeddings, `modules_to_save`, trained biases, a module the family lacks, an MoE's experts) is
  refused when the adapter is loaded, naming the field, as are a rank above `--max-lora-rank`, a tensor that
  does not fit its base projection, and a tensor that is not finite.
- Where it goes. Our q/k/v and gate/up are stacked (`qkv_proj`, `gate_up_proj`), so an adapter's parts of one
  stacked projection are stacked too: their A's one above the other ([R, in], R the sum of the parts' ranks) and
  their B's block-diagonal ([out, R]), each in its part's output rows; a part the adapter leaves out is zeros.
  The scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) is folded into B. Under tensor parallelism A and B
  are split as their base projection is: a column-parallel one keeps its B rows (its heads, its part of the
  intermediate size) and the whole A; a row-parallel one (o, down) its A columns and the whole B, its partial
  delta summed by the group with the base's partial product.
- Per-row deltas, batch invariant. A step may mix base rows and rows of several adapters; each row adds its own
  adapter's delta, with bits that depend on its inputs and adapter only:
  - On a CPU with pagoda's C++ kernels (AVX2 and FMA): one call per projection for every row of every adapter
    (pagoda/kernels/cpu_lora.cpp, the grouped idea of punica / S-LoRA), each row one fixed instruction sequence.
    The step's adapters are named by a `LoraTable` of addresses, one tensor for the runner's life, so a recorded
    decode step (pagoda/model/cpu_graphs.py, with `EngineConfig.enable_lora`) replays steps with adapter rows
    too: a LoRA node follows each adaptable product, and a base row's node does nothing.
  - Elsewhere (a GPU, a CPU without AVX2): each adapter's rows are gathered, padded to the kernel's row multiple,
    and multiplied by A and then B on the model's float matmul kernel (an int8 or int4 base keeps its adapters in
    float32), in calls of the row counts this machine proved row invariant (pagoda/model/invariance.py); the delta
    is added to its rows, one add per element.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pagoda.core.adapters import AdapterError, AdapterInfo
from pagoda.kernels import cpu_native
from pagoda.model.invariance import prove_row_invariance
from pagoda.model.llama import LinearThreads, Transformer
from pagoda.model.matmul import (MKL_PADDED, ONEDNN, ONEDNN_PACKED, PLAIN, TRITON_INVARIANT, Linear, MatmulKernel,
                                 PackedWeight, select_matmul)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_FLOAT_KERNELS = {k.name for k in (ONEDNN_PACKED, ONEDNN, MKL_PADDED, PLAIN, TRITON_INVARIANT)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
                  r"(?P<proj>[A-Za-z0-9_]+)\.lora_(?P<ab>[AB])\.weight$")
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint names


@dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json pagoda reads."""

    rank: int
    alpha: float
    rslora: bool

    def scaling(self, rank: int) -> float:
        """PEFT's scale of a module of rank `rank`: alpha / r, or alpha / sqrt(r) (rsLoRA)."""
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


def read_config(directory: Path, max_rank: int) -> LoraConfig:
    """adapter_config.json, checked: AdapterError naming the field pagoda cannot serve."""
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError(f"lora_path {str(directory)!r} is not a directory", "lora_path")
    if not path.is_file():
        raise AdapterError(f"lora_path {str(directory)!r} has no {CONFIG_FILE}", "lora_path")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {exc}", "lora_path") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object", "lora_path")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {raw.get('peft_type')!r}: only LoRA adapters are served", "peft_type")
    refused = {"use_dora": "DoRA adapters are not served", "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D) is not served",
               "modules_to_save": "modules_to_save (whole modules trained beside the adapter) are not served",
               "alpha_pattern": "per-module lora_alpha (alpha_pattern) is not served",
               "lora_bias": "trained LoRA biases are not served",
               "trainable_token_indices": "trained token embeddings are not served"}
    for name, why in refused.items():
        if raw.get(name):
            raise AdapterError(f"{name}: {why}", name)
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias {raw.get('bias')!r}: trained biases are not served (only 'none')", "bias")
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise AdapterError(f"r {rank} is above this server's --max-lora-rank {max_rank}", "r")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    # target_modules is not read: the tensors say which modules the adapter has (each checked by _parts)
    return LoraConfig(rank=rank, alpha=float(alpha), rslora=bool(raw.get("use_rslora")))


def adapter_kernel(model: Transformer) -> MatmulKernel:
    """The float kernel an adapter multiplies on: the model's own when it is a float one, else float32's here."""
    if model.matmul.name in _FLOAT_KERNELS:
        return model.matmul
    return select_matmul(next(model.parameters()).device, torch.float32)


@dataclass
class SegmentDelta:
    """One adapted projection for pagoda's C++ kernel: a segment per part of the stacked projection it adapts (q of
    qkv, gate of gate_up), each A [r, in] and its scaled B transposed, Bt [r, cols], at its first output column.
    `desc` [segments, 5] int64 gives the kernel their addresses (cpu_lora.cpp); the tensors live as long as it."""

    segments: list[tuple[Tensor, Tensor, int]]
    desc: Tensor

    @classmethod
    def of(cls, parts: list[tuple[Tensor, Tensor, int]]) -> SegmentDelta:
        segments = [(a.contiguous(), b.T.contiguous(), offset) for a, b, offset in parts]
        desc = torch.tensor([[a.data_ptr(), bt.data_ptr(), a.shape[0], offset, bt.shape[1]]
                             for a, bt, offset in segments], dtype=torch.int64)
        return cls(segments, desc)

    @property
    def rank(self) -> int:
        """The rows of its xa: every segment's rank."""
        return sum(a.shape[0] for a, _, _ in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + bt.numel() * bt.element_size() for a, bt, _ in self.segments)

    def packs(self) -> list[tuple[PackedWeight, Tensor]]:
        return []


@dataclass
class ProductDelta:
    """One adapted projection as two products on the model's float kernel (where the C++ kernel does not run): its
    parts' A's stacked [R, in] and their scaled B's block-diagonal [out, R], each in its part's output rows."""

    a: Tensor
    b: Tensor
    a_packed: PackedWeight
    b_packed: PackedWeight
    row_multiple: int

    @classmethod
    def of(cls, linear: Linear, parts: list[tuple[Tensor, Tensor, int]], kernel: MatmulKernel,
           device: torch.device) -> ProductDelta:
        total = sum(a.shape[0] for a, _, _ in parts)
        b_all = torch.zeros(linear.out_features, total)
        col = 0
        for a, b, offset in parts:
            b_all[offset : offset + b.shape[0], col : col + a.shape[0]] = b
            col += a.shape[0]
        delta = cls(torch.cat([a for a, _, _ in parts]).to(device), b_all.to(device), PackedWeight(kernel),
                    PackedWeight(kernel), kernel.row_multiple)
        delta.a_packed.pack(delta.a)
        delta.b_packed.pack(delta.b)
        return delta

    def delta(self, x: Tensor) -> Tensor:
        """x [n, in] -> scale * (x A) B [n, out], each row's bits its own (rows padded to the row multiple, calls of
        proven row counts)."""
        n = x.shape[0]
        pad = -n % self.row_multiple
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        return self.b_packed.product(self.a_packed.product(x.to(self.a.dtype), self.a, None), self.b, None)[:n]

    @property
    def nbytes(self) -> int:
        return self.a_packed.nbytes(self.a) + self.b_packed.nbytes(self.b)

    def packs(self) -> list[tuple[PackedWeight, Tensor]]:
        return [(self.a_packed, self.a), (self.b_packed, self.b)]


ModuleDelta = SegmentDelta | ProductDelta


@dataclass
class LoraAdapter:
    """A loaded adapter: the delta of each projection it adapts, by the model's Linear."""

    info: AdapterInfo
    modules: dict[Linear, ModuleDelta] = field(default_factory=dict)
    entries: Tensor | None = None  # its rows of the runner's LoraTable (pagoda's C++ kernel), kept with its tensors


@dataclass(frozen=True)
class _Part:
    """Where one checkpoint projection's adapter lands in our Linear: its rows of the output (column-parallel
    split), or its columns of the input (row-parallel split)."""

    linear: Linear
    out_offset: int  # first output row of the part in our (stacked) Linear
    rows: tuple[int, int] | None  # [start, end) of the checkpoint B's rows this rank keeps; None: all
    columns: tuple[int, int] | None  # [start, end) of the checkpoint A's columns this rank keeps; None: all
    full_out: int  # rows of the checkpoint's B
    full_in: int  # columns of the checkpoint's A


def _parts(model: Transformer, layer: int, block: str, proj: str, key: str) -> list[_Part]:
    """The parts of our Linears a checkpoint projection `proj` of `layer` adapts (three for Phi-3's fused qkv)."""
    config, shard = model.config, model.shard
    allowed = ATTENTION + MLP + (FUSED if config.family == "phi3" else ())
    if config.num_experts and block == "mlp":
        raise AdapterError(f"{key}: adapters of a mixture of experts' MLP are not served (attention only)",
                           "target_modules")
    if proj not in allowed or (proj in ATTENTION + ("qkv_proj",)) != (block == "self_attn"):
        raise AdapterError(f"{key}: this model ({config.architecture}) has no {block}.{proj} to adapt "
                           f"(adaptable: {', '.join(allowed)})", "target_modules")
    if layer >= len(model.model.layers):
        raise AdapterError(f"{key}: layer {layer} is past the model's {len(model.model.layers)} layers",
                           "target_modules")
    decoder = model.model.layers[layer]
    attn, mlp = decoder.self_attn, getattr(decoder, "mlp", None)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    if proj == "o_proj":
        return [_Part(attn.o_proj, 0, None, shard.columns("o_proj"), h, q)]
    if proj == "down_proj":
        return [_Part(mlp.down_proj, 0, None, shard.columns("down_proj"), h, inter)]
    # column-parallel: (checkpoint part, its offset in the checkpoint's B, its rows there)
    if block == "self_attn":
        names = {"q_proj": [("q_proj", 0, q)], "k_proj": [("k_proj", 0, kv)], "v_proj": [("v_proj", 0, kv)],
                 "qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]}[proj]
        offsets, linear = {"q_proj": 0, "k_proj": shard.q_size, "v_proj": shard.q_size + shard.kv_size}, attn.qkv_proj
    else:
        names = {"gate_proj": [("gate_proj", 0, inter)], "up_proj": [("up_proj", 0, inter)],
                 "gate_up_proj": [("gate_proj", 0, inter), ("up_proj", inter, inter)]}[proj]
        offsets, linear = {"gate_proj": 0, "up_proj": shard.intermediate_size}, mlp.gate_up_proj
    full_out = sum(n for _, _, n in names)
    parts = []
    for part, start, _ in names:
        lo, hi = shard.rows(part)  # this rank's rows of the part (all of them in a group of one)
        parts.append(_Part(linear, offsets[part], (start + lo, start + hi), None, full_out, h))
    return parts


def _read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise AdapterError(f"lora_path has no {WEIGHTS_FILE} (only safetensors adapters are served)", "lora_path")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}", "lora_path") from None


def load_adapter(model: Transformer, name: str, directory: str | Path, max_rank: int, *,
                 batch_invariant: bool = True, table: LoraTable | None = None) -> LoraAdapter:
    """Read, check and place a PEFT LoRA directory over `model` (this rank's shard of it); AdapterError if refused."""
    directory = Path(directory)
    config = read_config(directory, max_rank)
    tensors = _read_tensors(directory / WEIGHTS_FILE)
    pairs: dict[tuple[int, str, str], dict[str, tuple[str, Tensor]]] = {}
    for key, tensor in tensors.items():
        found = _KEY.match(key)
        if found is None:
            what = "an embedding adapter" if "embed" in key or "lm_head" in key else "a module pagoda cannot adapt"
            raise AdapterError(f"{key}: {what}; only the decoder's projections are served", "target_modules")
        if not torch.is_floating_point(tensor) or tensor.dim() != 2:
            raise AdapterError(f"{key}: a 2-D floating-point tensor is expected, got {tuple(tensor.shape)} "
                               f"{tensor.dtype}", key)
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{key}: holds NaN or infinite values", key)
        pairs.setdefault((int(found["layer"]), found["block"], found["proj"]), {})[found["ab"]] = (key, tensor)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors", "lora_path")
    kernel = adapter_kernel(model)
    device = next(model.parameters()).device
    stacked: dict[Linear, list[tuple[Tensor, Tensor, int]]] = {}  # Linear -> [(A part, scaled B part, out offset)]
    ranks, targets = set(), set()
    for (layer, block, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            key = next(iter(ab.values()))[0]
            raise AdapterError(f"{key}: its lora_{'B' if 'A' in ab else 'A'} is missing", key)
        (a_key, a), (b_key, b) = ab["A"], ab["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise AdapterError(f"{b_key}: shape {tuple(b.shape)} does not follow its lora_A's rank {rank}", b_key)
        if rank > max_rank:
            raise AdapterError(f"{a_key}: rank {rank} is above this server's --max-lora-rank {max_rank}", "r")
        parts = _parts(model, layer, block, proj, a_key)
        first = parts[0]
        if a.shape[1] != first.full_in:
            raise AdapterError(f"{a_key}: shape {tuple(a.shape)} does not fit {block}.{proj}'s {first.full_in} "
                               f"inputs", a_key)
        if b.shape[0] != first.full_out:
            raise AdapterError(f"{b_key}: shape {tuple(b.shape)} does not fit {block}.{proj}'s {first.full_out} "
                               f"outputs", b_key)
        ranks.add(rank)
        targets.add(proj)
        scale = config.scaling(rank)
        a, b = a.to(torch.float32), b.to(torch.float32) * scale
        for part in parts:
            part_a = a if part.columns is None else a[:, part.columns[0] : part.columns[1]]
            part_b = b if part.rows is None else b[part.rows[0] : part.rows[1]]
            stacked.setdefault(part.linear, []).append((part_a, part_b, part.out_offset))
    modules = {linear: _module_delta(linear, parts, kernel, device) for linear, parts in stacked.items()}
    prove_row_invariance([p for delta in modules.values() for p in delta.packs()], torch.float32, batch_invariant)
    info = AdapterInfo(name=name, path=str(directory), rank=max(ranks),
                       nbytes=sum(delta.nbytes for delta in modules.values()), target_modules=tuple(sorted(targets)))
    return LoraAdapter(info, modules, table.entries(modules) if table is not None else None)


def _module_delta(linear: Linear, parts: list[tuple[Tensor, Tensor, int]], kernel: MatmulKernel,
                  device: torch.device) -> ModuleDelta:
    """One Linear's parts (A, scaled B, first output row): segments for the C++ kernel, else stacked products."""
    if native(device):
        return SegmentDelta.of(parts)
    return ProductDelta.of(linear, parts, kernel, device)


def native(device: torch.device) -> bool:
    """Whether deltas run on pagoda's C++ kernel here (a CPU with AVX2 and FMA)."""
    return device.type == "cpu" and cpu_native.available()


class LoraTable:
    """Where a step's adapters are for pagoda's C++ kernel: each adaptable projection of the model by number, and a
    table [slots, projections, 3] int64 whose row `slot` holds (A's address, B^T's address, rank) of the adapter in
    that slot, for each projection (rank 0: it leaves the projection alone).

    The table is one tensor for the runner's life: a recorded step names it, and each step writes its adapters'
    rows into it before it runs (eager or replayed), so one program serves any mix of adapters."""

    def __init__(self, model: Transformer, slots: int, max_rank: int) -> None:
        self.index: dict[Linear, int] = {}
        self.width = 3 * max_rank  # the most rank rows one projection's parts hold (q, k and v of qkv)
        for layer in model.model.layers:
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if not model.config.num_experts:  # a mixture of experts adapts its attention only (_parts)
                linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
            for linear in linears:
                self.index[linear] = len(self.index)
        self.table = torch.zeros(slots, len(self.index), 3, dtype=torch.int64)

    def entries(self, modules: dict[Linear, ModuleDelta]) -> Tensor:
        """An adapter's rows of the table: [projections, 3]."""
        entries = torch.zeros(len(self.index), 3, dtype=torch.int64)
        for linear, delta in modules.items():
            entries[self.index[linear]] = torch.tensor([delta.desc.data_ptr(), len(delta.segments), delta.rank])
        return entries

    def place(self, adapters: list[LoraAdapter]) -> None:
        """Write the step's adapters into slots 0, 1, ... in order."""
        if len(adapters) > self.table.shape[0]:
            raise ValueError(f"{len(adapters)} adapters in one step, more than the {self.table.shape[0]} slots")
        for slot, adapter in enumerate(adapters):
            self.table[slot].copy_(adapter.entries)


@dataclass(frozen=True)
class LoraStep:
    """Which adapter each row of a step adds: `row_slot` [rows] indexes `adapters` (-1: the base, and padding).

    With a `table` (pagoda's C++ kernel) the adapters are written into its slots; without, `groups` holds each
    adapter's rows, ascending, for the products on the float kernel."""

    adapters: list[LoraAdapter]
    row_slot: Tensor
    table: LoraTable | None = None
    xa: Tensor | None = None  # the C++ kernel's scratch [rows, table.width]
    groups: list[Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, loaded: dict[str, LoraAdapter], names: Iterable[str | None], query_lens: Iterable[int],
           num_rows: int, device: torch.device, table: LoraTable | None) -> LoraStep:
        """Chunk i holds `query_lens[i]` consecutive rows and adds adapter `names[i]`; rows past them are padding."""
        adapters, which = slots_of(loaded, names, query_lens, num_rows)
        row_slot = torch.tensor(which, dtype=torch.int64)
        if table is not None:
            table.place(adapters)
            return cls(adapters, row_slot, table, torch.empty(num_rows, table.width))
        groups = [(row_slot == i).nonzero().flatten().to(device) for i in range(len(adapters))]
        return cls(adapters, row_slot.to(device), groups=groups)


def slots_of(loaded: dict[str, LoraAdapter], names: Iterable[str | None], query_lens: Iterable[int],
             num_rows: int) -> tuple[list[LoraAdapter], list[int]]:
    """The step's adapters in order of first appearance, and each row's slot among them (-1: none)."""
    order: dict[str, int] = {}
    which = [-1] * num_rows
    start = 0
    for name, n in zip(names, query_lens):
        if name is not None:
            which[start : start + n] = [order.setdefault(name, len(order))] * n
        start += n
    return [loaded[name] for name in order], which


class AdaptedLinears:
    """A step's linear layers with each row's adapter delta added (the design note)."""

    def __init__(self, inner: LinearThreads, step: LoraStep) -> None:
        self.inner, self.step = inner, step

    def linear(self, layer: Any, x: Tensor) -> Tensor:
        out = self.inner.linear(layer, x)
        step = self.step
        if step.table is not None:  # pagoda's C++ kernel: every row of every adapter in one call
            index = step.table.index.get(layer)
            if index is not None:
                cpu_native.lora_apply(out, x, step.table.table, index, step.row_slot, step.xa)
            return out
        for adapter, rows in zip(step.adapters, step.groups):
            delta = adapter.modules.get(layer)
            if delta is not None:
                out.index_add_(0, rows, delta.delta(x.index_select(0, rows)).to(out.dtype))
        return out

    def __getattr__(self, name: str) -> Any:  # the inner threads' own (StepThreads.step, ...)
        return getattr(self.inner, name)
