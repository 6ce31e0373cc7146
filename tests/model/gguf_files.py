"""Small GGUF files written the way llama.cpp's converter writes them: the importer's tests' oracle.

Independent of pagoda's importer: names come from the gguf library's own HF -> GGUF map
(`gguf.get_tensor_name_map`), Q/K rows are permuted with convert_hf_to_gguf.py's `permute` (the llama
architecture only), Gemma 3's norm weights are stored plus 1 (its converter's `norm_shift`), Phi-3's fused
`qkv_proj` / `gate_up_proj` are stored fused (`attn_qkv`, `ffn_up`) as its converter stores them, and every
2-D weight is stored in the asked type with the library's quantizer (`gguf.quants.quantize`), or, for the
types it can only read (the K-quants), as random blocks of that type with sane float16 scales. What a
file holds is returned as the library's dequantization in HF names and row order (norms back minus 1 for
Gemma 3): the reference an import must equal exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Every type the importer reads; the library quantizes all but the K-quants.
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# For random K-quant blocks: (byte offset, value) of each float16 scale (d, dmin) in a block, chosen so the
# weights stay within about +-0.1 and about centred (llama.cpp's ggml-common.h block layouts).
_K_SCALES = {
    "Q2_K": ((80, 2e-3), (82, 3e-3)),  # scales[16], qs[64], d, dmin
    "Q3_K": ((108, 8e-4),),  # hmask[32], qs[64], scales[12], d
    "Q4_K": ((0, 1e-4), (2, 7.5e-4)),  # d, dmin, scales[12], qs[128]
    "Q5_K": ((0, 6e-5), (2, 9e-4)),  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": ((208, 2e-5),),  # ql[128], qh[64], scales[16], d
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: HF rotate-half rows -> llama.cpp's adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `llama_cpp_permute`, by indexing (not the importer's reshape)."""
    order = llama_cpp_permute(np.arange(w.shape[0]), n_head)  # permuted row i is HF row order[i]
    out = np.empty_like(w)
    out[order] = w
    return out


def store(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`w` [out, in] float32 as the bytes (or floats) a GGUF tensor of `qtype` holds."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[qtype]
    if qtype in _K_SCALES:
        block, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for offset, scale in _K_SCALES[qtype]:
            d = (scale * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
            raw[..., offset:offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(w.shape[0], -1)
    return quantize(np.ascontiguousarray(w, dtype=np.float32), kind)


def dequantized(data: np.ndarray, qtype: str, shape: Sequence[int]) -> np.ndarray:
    """The library's float32 reading of stored data, shaped [out, in]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(shape)


def byte_level_vocab() -> dict[str, Any]:
    """A small byte-level BPE vocabulary (tokenizer.ggml.* values): 4 control tokens, 256 bytes, 4 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = control + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    return {
        "model": "gpt2", "pre": "smollm", "tokens": tokens, "merges": merges,
        "token_type": [3] * len(control) + [1] * (len(tokens) - len(control)),
        "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 3,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }


def write_gguf(path: Path, state: Mapping[str, Any], config: Any, qtype: str, *, arch: str = "llama",
               vocab: Mapping[str, Any] | None = None, seed: int = 0, raw_type: Mapping[str, str] | None = None,
               extra: Mapping[str, np.ndarray] | None = None,
               metadata: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Write `state` (HF names -> tensors) of a Llama-style `config` (transformers') as a GGUF of `arch`
    (llama, qwen2, qwen3, gemma3, phi3: the keys and tensor changes each one's converter makes).

    2-D weights are stored as `qtype` (`raw_type` overrides it per GGUF name: any GGMLQuantizationType,
    written as random bytes of the right size), 1-D ones as F32, as llama.cpp does; `extra` adds GGUF
    tensors as they are (F32); `metadata` adds keys (`{arch}` is replaced by `arch`; an int is written as
    uint32, a float as float32, a list as an array). Returns the reference: HF name -> the library's float32
    dequantization of what was written, in HF row order.
    """
    import gguf

    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the full layers' (the sliding layers' base is not written)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "phi3":
        writer.add_sliding_window(config.sliding_window or 0)  # 0: no window (Phi-4)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    for key, value in (metadata or {}).items():
        key = key.format(arch=arch)
        if isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    _add_vocab(writer, vocab or byte_level_vocab())

    reference: dict[str, np.ndarray] = {}
    for hf_name, tensor in state.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # llama.cpp writes no output.weight for tied embeddings
        w = tensor.detach().float().numpy()
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        permute = None
        if arch == "llama" and ".q_proj." in hf_name:
            permute = config.num_attention_heads
        elif arch == "llama" and ".k_proj." in hf_name:
            permute = config.num_key_value_heads
        if permute:
            w = llama_cpp_permute(w, permute)
        kind = (raw_type or {}).get(name, qtype if w.ndim == 2 else "F32")
        if raw_type and name in raw_type:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            data = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        shift = arch == "gemma3" and hf_name.endswith("norm.weight")  # Gemma3Model.norm_shift: stored as 1 + w
        if shift:
            w = w + np.float32(1)
        data = store(w, kind, rng)
        writer.add_tensor(name, data, raw_dtype=None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind])
        back = dequantized(data, kind, w.shape)
        if shift:
            back = back - np.float32(1)
        reference[hf_name] = llama_cpp_unpermute(back, permute) if permute else back
    for name, w in (extra or {}).items():
        writer.add_tensor(name, np.asarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _add_vocab(writer: Any, vocab: Mapping[str, Any]) -> None:
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        if key in vocab:
            writer.add_uint32(f"tokenizer.ggml.{key}", vocab[key])
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if key in vocab:
            writer.add_bool(f"tokenizer.ggml.{key}", vocab[key])
    if "chat_template" in vocab:
        writer.add_chat_template(vocab["chat_template"])
