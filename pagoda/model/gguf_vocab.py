"""Build tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary.

Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is supported: that is
what the default model uses. Its pieces are stored in the GPT-2 byte alphabet
(a space is "Ġ"), and the merges as "left right" pairs, so they go straight
into a `tokenizers` BPE model.

The text is split before BPE the way llama.cpp's `pre` names say. For
"smollm" (and the StarCoder family it shares its vocabulary with) every digit
is its own piece, then the GPT-2 regex applies; the vocabulary has no
multi-digit tokens, so this also matches the original Hugging Face tokenizer.

Control tokens (token_type 3, e.g. `<|im_start|>`) become special added tokens,
so they are matched whole in text and skipped when decoding with
skip_special_tokens; user-defined ones (type 4) become plain added tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp `tokenizer.ggml.pre` values whose split is "each digit alone, then GPT-2".
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"}
# Values whose split is the plain GPT-2 regex.
_GPT2_PRES = {"gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling"}


def build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a llama.cpp `tokenizer.ggml.pre` name (ValueError if unknown)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre is None or pre in _GPT2_PRES:
        return byte_level
    raise ValueError(f"GGUF 'tokenizer.ggml.pre' = {pre!r}: this text split is not supported by the importer")


def build_tokenizer_files(meta: Mapping[str, Any], context_length: int) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from a GGUF file's `tokenizer.*` metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF 'tokenizer.ggml.model' = {model!r}: only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens"))
    merges: list[str] = list(meta.get("tokenizer.ggml.merges", []))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(set(tokens)) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens; cannot build a BPE vocabulary from it")

    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not a 'left right' pair")
        pairs.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = build_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    tok.post_processor = _post_processor(tok, bos if add_bos else None, eos if add_eos else None)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok, config


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    """Adds BOS/EOS on encode(add_special_tokens=True) when the file asks for them."""
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)

    def framed(seq: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] if bos else []) + [f"${seq}:{type_id}"] + ([f"{eos}:{type_id}"] if eos else [])

    edge_tokens = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(
        single=" ".join(framed("A", 0)),
        pair=" ".join(framed("A", 0) + framed("B", 1)),
        special_tokens=[(t, tok.token_to_id(t)) for t in edge_tokens],
    )
