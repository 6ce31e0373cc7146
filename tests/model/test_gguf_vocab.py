"""Tokenizers built from a GGUF file's vocabulary: SentencePiece (`llama`) and byte-level BPE's text splits.

Small hand-made vocabularies; the oracle is transformers' own GGUF tokenizer loading
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), on files written with the gguf library.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.model.gguf_vocab import build_tokenizer_files, sentencepiece_merges

WORDS = ["hello", "world", "the", "there", "this", "is", "a", "test", "help", "held", "token", "tokenizer", "in", "thing"]
CONTROL = ["<unk>", "<s>", "</s>", "<|user|>"]  # unknown, bos, eos, a control token of a chat template
STRINGS = ["hello world", "Hello, world!", "the thing is a tokenizer test", "helping", "héllo 中文 🙂", "a\nb\n\nc",
           "tab\there", "x", ""]
# Text where transformers' `llama` GGUF tokenizer (Metaspace, prefix on the first piece only) and llama.cpp
# (a "▁" before the text and after each special token) differ; pagoda follows llama.cpp, as transformers'
# phi3 GGUF tokenizer (and the original Llama 2 tokenizer.json) do.
LLAMA_CPP_STRINGS = ["  two spaces", " ", "<s>hello</s> there", "hello<|user|>this is", "<|user|>\nhelp"]


def spm_vocab(add_space_prefix: bool = True, user_defined: bool = False) -> dict:
    """tokenizer.ggml.* of a small SentencePiece BPE: control, 256 byte tokens, characters, then merged pieces
    (every prefix of each "▁word", and a few word-inner pieces), scored best-first in vocabulary order."""
    space = "\u2581" if add_space_prefix else ""
    chars = sorted(set("".join(WORDS)) | set("HTW,.!'?"))
    pieces = {(space + w)[:n] for w in WORDS for n in range(2, len(space + w) + 1)} | {"ing", "er", "ll", "lo", "he", "th"}
    pieces = sorted(pieces, key=lambda p: (len(p), p))
    tokens = CONTROL + [f"<0x{i:02X}>" for i in range(256)] + ["\u2581"] + chars + pieces
    types = [2, 3, 3, 4 if user_defined else 3] + [6] * 256 + [1] * (1 + len(chars) + len(pieces))
    scores = [0.0] * (len(CONTROL) + 256) + [-1000.0 - i for i in range(1 + len(chars))] + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "token_type": types, "scores": scores, "bos_token_id": 1,
            "eos_token_id": 2, "unknown_token_id": 0, "add_space_prefix": add_space_prefix}


def meta_of(vocab: dict) -> dict:
    """The vocabulary as GGUF metadata (what the importer hands build_tokenizer_files)."""
    return {("tokenizer.chat_template" if k == "chat_template" else f"tokenizer.ggml.{k}"): v for k, v in vocab.items()}


def write_vocab_gguf(path: Path, vocab: dict, arch: str = "llama") -> Path:
    import gguf

    from tests.model.gguf_files import _add_vocab

    writer = gguf.GGUFWriter(str(path), arch)
    _add_vocab(writer, vocab)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_sentencepiece_round_trips_byte_fallback_and_control_tokens():
    vocab = spm_vocab()
    tok, config = build_tokenizer_files(meta_of(vocab), context_length=64)
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    for text in STRINGS + ["  two spaces", " ", " x "]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("hello world").ids == [1, ids["\u2581hello"], ids["\u2581world"]]  # BOS added by default
    assert config["add_bos_token"] is True and (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<s>", "</s>", "<unk>")
    # characters outside the vocabulary are spelt in UTF-8 bytes: é is C3 A9, 中 is E4 B8 AD
    assert tok.encode("é中", add_special_tokens=False).ids == [ids["\u2581"], ids["<0xC3>"], ids["<0xA9>"], ids["<0xE4>"],
                                                               ids["<0xB8>"], ids["<0xAD>"]]
    # control tokens written in text are matched whole, and a "▁" starts the text after them (llama.cpp)
    assert tok.encode("<s>this<|user|>is", add_special_tokens=False).ids == [1, ids["\u2581this"], 3, ids["\u2581is"]]
    assert tok.decode([1, ids["\u2581this"], 2], skip_special_tokens=False) == "<s> this</s>"


def test_sentencepiece_merges_follow_the_scores():
    """SentencePiece merges the pair whose joined token scores best; which token wins changes the split."""
    base = ["\u2581", "a", "b", "c"]
    for scores, want in (({"\u2581a": -1.0, "bc": -0.5, "\u2581ab": -2.0}, ["\u2581a", "bc"]),
                         ({"\u2581a": -0.5, "bc": -2.0, "\u2581ab": -1.0}, ["\u2581ab", "c"])):
        tokens = ["<unk>"] + base + list(scores)
        meta = meta_of({"model": "llama", "tokens": tokens, "token_type": [2] + [1] * (len(tokens) - 1),
                        "scores": [0.0] + [-10.0] * len(base) + list(scores.values()), "add_bos_token": False})
        tok, _ = build_tokenizer_files(meta, 64)
        assert tok.encode("abc").tokens == want
    merges = sentencepiece_merges(["ab", "a", "b", "<0x41>", "<s>s"], [-1.0, 0, 0, 0, 5.0], [1, 1, 1, 6, 3])
    assert merges == [("a", "b")]  # byte and control tokens are never formed by merging


def test_sentencepiece_matches_transformers(tmp_path):
    for user_defined in (False, True):
        vocab = spm_vocab(user_defined=user_defined)
        ours, _ = build_tokenizer_files(meta_of(vocab), 64)
        phi3 = hf_gguf_tokenizer(write_vocab_gguf(tmp_path / f"phi3-{user_defined}.gguf", vocab, arch="phi3"))
        llama = hf_gguf_tokenizer(write_vocab_gguf(tmp_path / f"llama-{user_defined}.gguf", vocab, arch="llama"))
        for text in STRINGS + LLAMA_CPP_STRINGS:
            ids = ours.encode(text).ids
            assert ids == phi3.encode(text), text
            assert ours.decode(ids) == phi3.decode(ids, skip_special_tokens=True), text
            if text not in LLAMA_CPP_STRINGS:
                assert ids == llama.encode(text), text


def test_sentencepiece_without_a_space_prefix(tmp_path):
    """Gemma's files set add_space_prefix false: no "▁" is added, none is stripped."""
    vocab = spm_vocab(add_space_prefix=False)
    ours, _ = build_tokenizer_files(meta_of({**vocab, "add_bos_token": False}), 64)
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    assert ours.encode("hello").ids == [ids["hello"]]
    assert ours.encode(" hi").tokens == ["\u2581", "h", "i"]
    assert ours.decode(ours.encode(" hello world").ids) == " hello world"
    # transformers' Gemma GGUF tokenizer: no "▁" added (its merges follow file order, the same order here)
    theirs = hf_gguf_tokenizer(write_vocab_gguf(tmp_path / "gemma3.gguf", {**vocab, "add_bos_token": False}, arch="gemma3"))
    for text in STRINGS + LLAMA_CPP_STRINGS:
        assert ours.encode(text).ids == theirs.encode(text), text


BYTE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ 1", "' s", "o u", "y ou", "Ġ you", "Ċ Ċ",
               "2 3", "Ġ Ġ"]
BYTE_STRINGS = ["the 12345 and 123", "you's in 2023\n\nok", "It'S  x  1", "tab\t1 22 333 4444", "émoji 🙂!", "a\r\nb",
                "<|im_start|>user\n12<|im_end|>"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_text_splits_match_transformers(pre, tmp_path):
    """Llama 3's regex keeps numbers in runs of up to three digits, Qwen2's splits every digit."""
    from tests.model.gguf_files import byte_level_vocab

    vocab = {**byte_level_vocab(), "pre": pre, "merges": BYTE_MERGES}
    vocab["tokens"] = vocab["tokens"][:260] + [m.replace(" ", "") for m in BYTE_MERGES]
    vocab["token_type"] = [3] * 4 + [1] * (len(vocab["tokens"]) - 4)
    ours, _ = build_tokenizer_files(meta_of(vocab), 64)
    theirs = hf_gguf_tokenizer(write_vocab_gguf(tmp_path / f"{pre}.gguf", vocab, arch="qwen2" if pre == "qwen2" else "llama"))
    for text in BYTE_STRINGS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    numbers = ours.encode("123123", add_special_tokens=False).tokens
    assert numbers == (["123", "123"] if pre == "llama-bpe" else ["1", "2", "3", "1", "2", "3"])


def test_imported_sentencepiece_tokenizer_loads_in_pagoda(tmp_path):
    """tokenizer.json + tokenizer_config.json as the importer writes them, through pagoda's Tokenizer."""
    from pagoda.core.tokenizer import Tokenizer

    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    vocab = {**spm_vocab(), "chat_template": template}
    tok, config = build_tokenizer_files(meta_of(vocab), 64)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and 0 in ours.special_token_ids
    ids = ours.encode_chat([{"role": "user", "content": "hello"}])
    assert ids[0] == 1 and ids.count(1) == 1  # the template writes BOS; encode_chat adds none
    assert ours.decode(ours.encode("héllo there")) == "héllo there"
    vocab_info = ours.token_vocab()
    assert vocab_info.encoding == "byte_fallback" and vocab_info.add_prefix_space is True
    stream = ours.text_stream()
    pieces = [stream.push(i) for i in ours.encode("this is a tëst", add_special_tokens=False)]
    assert "".join(pieces) + stream.flush() == "this is a tëst"


def test_tokenizer_model_refusals():
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.model' = 't5' is not supported"):
        build_tokenizer_files(meta_of({**spm_vocab(), "model": "t5"}), 64)
    vocab = spm_vocab()
    with pytest.raises(ValueError, match="duplicate tokens.*'\u2581hello'"):
        build_tokenizer_files(meta_of({**vocab, "tokens": vocab["tokens"][:-1] + ["\u2581hello"]}), 64)
