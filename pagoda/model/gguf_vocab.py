"""Build tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary.

Two vocabulary models, as llama.cpp names them in `tokenizer.ggml.model`:

- `gpt2`: byte-level BPE (SmolLM, Llama 3, Qwen2). The pieces are stored in the
  GPT-2 byte alphabet (a space is "Ġ") and the merges as "left right" pairs, so
  they go straight into a `tokenizers` BPE model. The text is split before BPE
  the way llama.cpp's `tokenizer.ggml.pre` names say: for "smollm" (and the
  StarCoder family it shares its vocabulary with) every digit is its own piece,
  then the GPT-2 regex applies; "llama-bpe" is Llama 3's regex (numbers in runs
  of up to three digits), "qwen2" Qwen's (every digit alone).
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3). The file holds
  tokens, scores and token types but no merges; a space is "▁", and characters
  missing from the vocabulary are spelt as byte tokens `<0x00>`..`<0xFF>`. The
  merges are derived from the scores (a pair merges with the score of the
  token it makes, best first), which is the order llama.cpp's SentencePiece
  tokenizer merges in. As llama.cpp (and the original Llama 2 tokenizer.json)
  does, when `tokenizer.ggml.add_space_prefix` is true (the default) a "▁" is
  put before the text and before the text after each special token; decoding
  drops one leading space.

Control tokens (token_type 3, e.g. `<|im_start|>`, `<s>`) and the unknown token
(type 2) become special added tokens, so they are matched whole in text and
skipped when decoding with skip_special_tokens; user-defined ones (type 4)
become plain added tokens, matched whole too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6
SPACE_MARK = "\u2581"  # "▁": SentencePiece's space
SUPPORTED_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values

# llama.cpp `tokenizer.ggml.pre` values whose split is "each digit alone, then GPT-2".
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"}
# Values whose split is the plain GPT-2 regex.
_GPT2_PRES = {"gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling"}
# llama.cpp's regexes (llama-vocab.cpp) for the values that have their own.
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_PRES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer for a llama.cpp `tokenizer.ggml.pre` name (ValueError if unknown)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre is None or pre in _GPT2_PRES:
        return byte_level
    known = sorted(_DIGIT_SPLIT_PRES | _GPT2_PRES | set(_REGEX_PRES))
    raise ValueError(f"GGUF 'tokenizer.ggml.pre' = {pre!r}: this text split is not supported by the importer "
                     f"(supported: {', '.join(known)})")


def build_tokenizer_files(meta: Mapping[str, Any], context_length: int) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from a GGUF file's `tokenizer.*` metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise ValueError(f"GGUF 'tokenizer.ggml.model' = {model!r} is not supported "
                         f"(supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE))")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata key 'tokenizer.ggml.tokens' is missing")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise ValueError(f"GGUF vocabulary has duplicate tokens (e.g. {dup!r}); cannot build a vocabulary from it")

    def token_of(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    unk = token_of("unknown_token_id")
    if model == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
        add_bos_default = False
    else:
        if unk is None:
            unk = next((t for t, k in zip(tokens, types) if k == TOKEN_TYPE_UNKNOWN), None)
        scores = list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
        tok = _sentencepiece_bpe(tokens, scores, types, unk, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    post = _post_processor(tok, bos if add_bos else None, eos if add_eos else None, byte_level=model == "gpt2")
    if post is not None:
        tok.post_processor = post

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": token_of("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok, config


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    """`tokenizer.ggml.model = gpt2`: the file's merges over GPT-2-alphabet pieces."""
    pairs = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not a 'left right' pair")
        pairs.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = build_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: Sequence[float], types: Sequence[int], unk: str | None,
                       add_space_prefix: bool) -> Tokenizer:
    """`tokenizer.ggml.model = llama`: BPE over "▁"-spelt pieces, merges from the scores, byte fallback."""
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # A normalizer, not a pre-tokenizer: it runs on every stretch of text between special tokens, so each gets
    # its "▁" (llama.cpp's is_prev_special), even one that already starts with a space.
    space = [normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*space, normalizers.Replace(" ", SPACE_MARK)])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's: every split (left, right) of a token into two tokens,
    ranked by the joined token's score, best first (ties: the longer left part first, then vocabulary order).

    Only normal and user-defined tokens take part: control, unknown, unused and byte tokens are never
    formed by merging."""
    mergeable = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)}
    candidates = []
    for token, i in mergeable.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = sorted(((l, r) for l, r in splits if l in mergeable and r in mergeable),
                        key=lambda lr: (mergeable[lr[0]], mergeable[lr[1]]))
        candidates += [(float(scores[i]), len(l), len(r), l, r) for l, r in splits]
    candidates.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)  # stable: equal keys keep vocabulary order
    return [(l, r) for _, _, _, l, r in candidates]


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None, *, byte_level: bool) -> processors.PostProcessor | None:
    """Adds BOS/EOS on encode(add_special_tokens=True) when the file asks for them."""
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None

    def framed(seq: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] if bos else []) + [f"${seq}:{type_id}"] + ([f"{eos}:{type_id}"] if eos else [])

    edge_tokens = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(
        single=" ".join(framed("A", 0)),
        pair=" ".join(framed("A", 0) + framed("B", 1)),
        special_tokens=[(t, tok.token_to_id(t)) for t in edge_tokens],
    )
