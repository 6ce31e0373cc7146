"""How one GGUF `general.architecture` maps onto a Hugging Face checkpoint: the importer's architecture seam.

Design note. The importer (`gguf_import.py`) knows GGUF as a container: tensor types, shapes, the
tokenizer, writing the directory. Everything that depends on the architecture is a `GgufLayout`, plain
data plus two functions, so a new family adds one value here (or in its own module) and passes it to
`import_gguf(..., layouts=...)`; the importer has no branch per architecture.

What differs between architectures, and what a layout says about it:
- `config`: which metadata keys hold the sizes (`llama.block_count`, `qwen2.block_count`, ...), and
  what config.json they become (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...).
- `layer_names` / `global_names`: llama.cpp's tensor names (`blk.N.attn_q.weight`, `token_embd.weight`)
  and their Hugging Face names. A GGUF tensor the layout does not name is refused, never dropped.
- `permute_qk`: llama.cpp's converter reorders the rows of attn_q / attn_k inside each head for its
  adjacent-pairs RoPE, but only for the `llama` architecture (and the few that reuse its converter);
  Qwen2's rows are stored as Hugging Face has them (llama.cpp runs NeoX RoPE there).
- `fix_tensor`: a per-tensor fix-up for converters that store a weight changed (Gemma's adds 1 to
  its norm weights, so a Gemma layout subtracts it again).
- `ignored`: tensors that are not weights, e.g. Llama 3.1's `rope_freqs.weight`, which `config` reads
  back into `rope_scaling`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.model.config import FULL_ATTENTION, SLIDING_ATTENTION

ConfigFn = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
FixTensorFn = Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray]

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GgufLayout:
    """How the GGUF files of some `general.architecture` values become a Hugging Face directory."""

    architectures: tuple[str, ...]  # the `general.architecture` values this layout reads
    # (metadata: GGUF key -> value, tensors: GGUF name -> gguf ReaderTensor) -> config.json;
    # ValueError naming the key that is missing or not supported
    config: ConfigFn
    layer_names: Mapping[str, str]  # `blk.N.<suffix>` -> `model.layers.N.<suffix>`
    global_names: Mapping[str, str]  # every other GGUF tensor name -> its HF name
    permute_qk: bool = False  # attn_q / attn_k rows are in llama.cpp's per-head RoPE order
    # (HF name, float32 array in torch layout, config) -> the HF weight; the array may be read-only
    fix_tensor: FixTensorFn | None = None
    ignored: frozenset[str] = field(default_factory=frozenset)  # GGUF tensors that are not weights

    def __post_init__(self) -> None:
        if not self.architectures:
            raise ValueError("a GgufLayout needs at least one general.architecture name")

    @property
    def name(self) -> str:
        return self.architectures[0]

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a GGUF tensor (ValueError for one this layout does not know)."""
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        m = _BLOCK.match(gguf_name)
        if m and m.group(2) in self.layer_names:
            return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}"
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the {self.name!r} layout; "
                         "this file is not supported")

    def torch_rows(self, gguf_name: str, rows: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
        """`rows` ([out, ...]: weights, a bias, or quantized blocks) put in the HF row order."""
        if not self.permute_qk:
            return rows
        kind = gguf_name.rsplit(".", 2)[-2] if gguf_name.count(".") >= 2 else ""
        if kind == "attn_q":
            return unpermute_rows(rows, config["num_attention_heads"])
        if kind == "attn_k":
            return unpermute_rows(rows, config["num_key_value_heads"])
        return rows


def layouts_by_architecture(*layouts: GgufLayout) -> dict[str, GgufLayout]:
    """{general.architecture: layout} for `import_gguf(..., layouts=...)`; a name claimed twice is an error."""
    table: dict[str, GgufLayout] = {}
    for layout in layouts:
        for arch in layout.architectures:
            if arch in table:
                raise ValueError(f"general.architecture {arch!r} has two GGUF layouts")
            table[arch] = layout
    return table


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row order (adjacent RoPE pairs) to HF's rotate-half order.

    w: [n_head * head_dim, ...] (weights, a bias, or blocks of a row). Within a head,
    llama.cpp row 2*j + s holds HF row s * head_dim/2 + j.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    if n_head * head_dim != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    tail = w.shape[1:]
    # [n_head, head_dim/2, 2, *tail] -> [n_head, 2, head_dim/2, *tail]
    return w.reshape(n_head, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's names for the tensors of a Llama-style decoder layer (gguf-py's tensor_mapping.py).
LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LLAMA_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: per-frequency RoPE divisors, written instead of rope_scaling


def decoder_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], *, arch: str, architecture: str,
                   model_type: str, sliding_window: bool = False) -> dict[str, Any]:
    """config.json of a Llama-style decoder from `<arch>.*` metadata (the keys every such converter writes).

    `<arch>.attention.sliding_window` is refused unless `sliding_window` says the caller reads it itself."""

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata key '{arch}.{key}' is missing")
        return value

    for key in ("expert_count", *(() if sliding_window else ("attention.sliding_window",))):
        if meta.get(f"{arch}.{key}"):
            raise ValueError(f"GGUF metadata key '{arch}.{key}' = {meta[f'{arch}.{key}']}: "
                             f"not supported by the {arch!r} layout")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"GGUF metadata key '{arch}.rope.scaling.type' = {scaling!r}: RoPE scaling of this type "
                         "is not supported (supported: none, linear)")
    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv") or n_head)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_head)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"GGUF metadata key '{arch}.rope.dimension_count' = {rope_dim}: RoPE on part of a head "
                         f"(head_dim {head_dim}) is not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF tensor 'token_embd.weight' is missing")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists [hidden, vocab]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": short_float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": short_float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        "rope_scaling": {"rope_type": "linear", "factor": short_float(need("rope.scaling.factor"))}
        if scaling == "linear" else None,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": vocab_size,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }


def llama_config(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """LlamaForCausalLM; Llama 3.1's `rope_freqs.weight` becomes a `llama3` rope_scaling."""
    config = decoder_config(meta, tensors, arch="llama", architecture="LlamaForCausalLM", model_type="llama")
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config["mlp_bias"] = False
    if ROPE_FREQS in tensors:
        if config["rope_scaling"] is not None:
            raise ValueError(f"GGUF has both 'llama.rope.scaling.type' and {ROPE_FREQS!r}; this file is not supported")
        from gguf.quants import dequantize

        t = tensors[ROPE_FREQS]
        factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        config["rope_scaling"] = llama3_scaling(factors, config["rope_theta"], config["head_dim"])
    return config


def qwen2_config(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2ForCausalLM: biases on q/k/v (not o), no sliding window."""
    config = decoder_config(meta, tensors, arch="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2")
    if "blk.0.attn_q.bias" not in tensors:
        raise ValueError("GGUF tensor 'blk.0.attn_q.bias' is missing: a qwen2 file has biases on q/k/v")
    config["use_sliding_window"] = False
    return config


def qwen3_config(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3ForCausalLM: per-head q/k norms, no biases (a bias tensor has no name in the layout, so it is
    refused), head_dim from `qwen3.attention.key_length`, no sliding window."""
    config = decoder_config(meta, tensors, arch="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3")
    for name in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"):
        if name not in tensors:
            raise ValueError(f"GGUF tensor {name!r} is missing: a qwen3 file has per-head q/k norms")
    config["attention_bias"] = False
    config["use_sliding_window"] = False
    return config


GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's fixed RoPE base of Gemma 3's sliding layers
GEMMA3_PATTERN = 6  # llama.cpp's default: every 6th layer is a full one
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's scores by (hidden / heads)^-1/2, the others' by head_dim^-1/2


def gemma3_config(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma3ForCausalLM (`gemma3_text`), as llama.cpp runs a `gemma3` file.

    - layer kinds: none slide without `gemma3.attention.sliding_window`; else `sliding_window_pattern` (an
      integer n: every nth layer full, 0 all sliding, as llama.cpp's set_swa_pattern; or one bool per layer,
      true = sliding), by default 6;
    - RoPE: `gemma3.rope.freq_base` and `rope.scaling.*` (linear) for the full layers; the sliding layers'
      base is `gemma3.rope.freq_base_swa` where the file has it, else llama.cpp's fixed 10000, unscaled;
    - `query_pre_attn_scalar` is not in the file: head_dim, except for the 27B (62 layers), hidden / heads
      (168), as llama.cpp decides it;
    - tanh GELU; `gemma3.final_logit_softcapping` where the file has it.
    """
    config = decoder_config(meta, tensors, arch="gemma3", architecture="Gemma3ForCausalLM", model_type="gemma3_text",
                            sliding_window=True)
    layers = config["num_hidden_layers"]
    window = int(meta.get("gemma3.attention.sliding_window") or 0)
    types = _gemma3_layer_types(meta, layers) if window else [FULL_ATTENTION] * layers
    scaling = config.pop("rope_scaling")
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if scaling is not None:
        full.update(scaling)
    local_theta = meta.get("gemma3.rope.freq_base_swa") or GEMMA3_LOCAL_THETA
    local = {"rope_type": "default", "rope_theta": short_float(local_theta)}
    if layers == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    softcap = meta.get("gemma3.final_logit_softcapping")
    del config["hidden_act"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        layer_types=types,
        sliding_window=window or None,
        rope_parameters={FULL_ATTENTION: full, SLIDING_ATTENTION: local},
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=short_float(softcap) if softcap else None,
        attn_logit_softcapping=None,
        attention_bias=False,
    )
    return config


def _gemma3_layer_types(meta: Mapping[str, Any], layers: int) -> list[str]:
    key = "gemma3.attention.sliding_window_pattern"
    pattern = meta.get(key, GEMMA3_PATTERN)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers or not all(isinstance(p, (bool, np.bool_)) for p in pattern):
            raise ValueError(f"GGUF metadata key {key!r} = {pattern!r}: must be one bool per layer ({layers})")
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, (int, np.integer)) and not isinstance(pattern, bool) and pattern >= 0:
        n = int(pattern)  # llama.cpp's set_swa_pattern: layer i slides when i % n < n - 1
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    else:
        raise ValueError(f"GGUF metadata key {key!r} = {pattern!r}: must be a non-negative integer "
                         "or one bool per layer")
    return [SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding]


def gemma3_fix_tensor(name: str, w: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's converter stores every Gemma 3 RMSNorm weight as 1 + w (the HF checkpoint's w): take the 1 off."""
    return w - np.float32(1) if name.endswith("norm.weight") else w


PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # longrope (Phi-3 *-128k)


def phi3_config(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Phi3ForCausalLM: `phi3.attention.sliding_window` (0: none) over every layer; longrope refused."""
    for name in PHI3_ROPE_FACTORS:
        if name in tensors:
            raise ValueError(f"GGUF tensor {name!r}: Phi-3's long-context RoPE scaling (longrope) is not supported")
    attn_factor = meta.get("phi3.rope.scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise ValueError(f"GGUF metadata key 'phi3.rope.scaling.attn_factor' = {attn_factor}: scaled RoPE "
                         "(longrope, yarn) is not supported")
    config = decoder_config(meta, tensors, arch="phi3", architecture="Phi3ForCausalLM", model_type="phi3",
                            sliding_window=True)
    config["sliding_window"] = int(meta.get("phi3.attention.sliding_window") or 0) or None
    return config


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The `llama3` rope_scaling that gives llama.cpp's per-frequency divisors `factors` [head_dim/2].

    llama.cpp's converter writes, for each frequency of wavelength w: 1 when w < L/hi, `factor` when
    w > L/lo, else 1 / ((1 - s) / factor + s) with s = (L/w - lo) / (hi - lo). Only L/lo and L/hi
    matter, so lo is taken as 1 (every Llama 3.x has it) and L, hi are solved from the middle band;
    the result is checked by recomputing the factors.
    """
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"GGUF tensor {ROPE_FREQS!r} has {factors.size} values, expected head_dim/2 = {head_dim // 2}")
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    candidates = [{"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}]
    middle = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and middle.sum() >= 2:
        smooth = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)  # = a / w + b
        a, b = np.polyfit(1 / wavelen[middle], smooth, 1)
        if b < 0:  # lo = 1: hi - lo = -1/b, L = a (hi - lo); the rounded values first (4.0, not 3.99999995)
            hi, L = float(1 - 1 / b), int(round(-a / b))
            candidates += [{"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": h,
                            "original_max_position_embeddings": L} for h in (round(hi, 4), hi)]
    for scaling in candidates:
        if np.allclose(_llama3_factors(scaling, wavelen), factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", **scaling}
    raise ValueError(f"GGUF tensor {ROPE_FREQS!r} does not match Llama 3 RoPE scaling; this file is not supported")


def _llama3_factors(s: Mapping[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's converter's rope factors for a llama3 rope_scaling."""
    L, lo, hi, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    smooth = (L / wavelen - lo) / (hi - lo)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < L / hi, 1.0, np.where(wavelen > L / lo, factor, middle))


def short_float(x: float) -> float:
    """A float32 read from the file as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


LLAMA_GGUF = GgufLayout(
    architectures=("llama",),  # Llama 1/2/3.x, SmolLM, and Mistral files (written as llama)
    config=llama_config,
    layer_names=LLAMA_LAYER_NAMES,
    global_names=LLAMA_GLOBAL_NAMES,
    permute_qk=True,
    ignored=frozenset({ROPE_FREQS}),
)
QWEN2_GGUF = GgufLayout(
    architectures=("qwen2",),
    config=qwen2_config,
    layer_names={k: v for k, v in LLAMA_LAYER_NAMES.items() if k != "attn_output.bias"},
    global_names=LLAMA_GLOBAL_NAMES,
    permute_qk=False,
)

QWEN3_GGUF = GgufLayout(
    architectures=("qwen3",),  # Qwen3 dense (qwen3moe is another architecture, not imported)
    config=qwen3_config,
    layer_names={**{k: v for k, v in LLAMA_LAYER_NAMES.items() if not k.endswith(".bias")},
                 "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
    global_names=LLAMA_GLOBAL_NAMES,
    permute_qk=False,  # NeoX RoPE in llama.cpp: rows as HF has them
)
GEMMA3_GGUF = GgufLayout(
    architectures=("gemma3",),  # Gemma 3 text (the vision tower, if any, is a separate mmproj file)
    config=gemma3_config,
    layer_names={
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        **{k: v for k, v in LLAMA_LAYER_NAMES.items() if not k.endswith(".bias") and "norm" not in k},
    },
    global_names=LLAMA_GLOBAL_NAMES,
    permute_qk=False,
    fix_tensor=gemma3_fix_tensor,
)
PHI3_GGUF = GgufLayout(
    architectures=("phi3",),  # Phi-3 / Phi-3.5 mini and medium (4k windows; longrope refused), Phi-4
    config=phi3_config,
    layer_names={
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",  # q, k, v rows stacked, as HF's checkpoint
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate then up rows (2 x feed_forward_length), as HF's
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    global_names=LLAMA_GLOBAL_NAMES,
    permute_qk=False,  # NeoX RoPE in llama.cpp
)
