"""pagoda.core.tokenizer on the default model's imported tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagoda.core.text_stream import TextStream
from pagoda.core.tokenizer import Tokenizer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_PREFIX = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Don't stop; we'll see, they've gone!",
    "def f(x):\n    return x**2  # square\n\n\tclass A:\n        pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++",
    "😀 emoji 👍🏽 skin tone, flag 🇫🇷, family 👨‍👩‍👧",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "Ωmega ß café naïve Ελληνικά русский",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "abc<|endoftext|>def<jupyter_code>x=1<file_sep>",
    "Numbers: 3.14159, 2024-01-01, 1,000,000 and 12345678901234",
    "mixed\r\n\r\nlines\n\n\n   indented\t\ttabs",
    "   leading and trailing   ",
    "",
    " ",
]


def test_france_prompt_ids(default_tokenizer: Tokenizer):
    ids = default_tokenizer.encode_chat(FRANCE)
    assert len(ids) == 37 and ids[:10] == FRANCE_PREFIX
    assert ids[-4:] == default_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_special_ids_and_sizes(default_tokenizer: Tokenizer):
    assert default_tokenizer.eos_token_ids == (2,)
    assert default_tokenizer.bos_token_id == 1
    assert default_tokenizer.vocab_size == 49152
    assert default_tokenizer.special_token_ids == frozenset(range(17))  # the file's control tokens
    # add_bos_token is false for this model, so add_special_tokens adds nothing.
    assert default_tokenizer.encode("hi", add_special_tokens=True) == default_tokenizer.encode("hi", add_special_tokens=False)


def test_same_ids_as_transformers_gguf_tokenizer(default_tokenizer: Tokenizer, hf_gguf_tokenizer):
    for text in TEXTS:
        assert default_tokenizer.encode(text, add_special_tokens=False) == hf_gguf_tokenizer.encode(text, add_special_tokens=False), text


def test_control_tokens_are_matched_whole(default_tokenizer: Tokenizer):
    ids = default_tokenizer.encode("a<|im_start|>b<|im_end|><repo_name>", add_special_tokens=False)
    assert 1 in ids and 2 in ids and 3 in ids
    assert len(ids) == 5
    assert default_tokenizer.decode(ids) == "ab"
    assert default_tokenizer.decode(ids, skip_special_tokens=False) == "a<|im_start|>b<|im_end|><repo_name>"


def test_digits_are_split_before_bpe(default_tokenizer: Tokenizer):
    """The file's pre-tokenizer 'smollm' isolates each digit first (as llama.cpp does for it).

    Only whitespace runs before a digit show it: "x  1" is x, "ĠĠ", 1, not x, "Ġ", "Ġ", 1.
    """
    tok = default_tokenizer
    ids = tok.encode("x  1", add_special_tokens=False)
    assert [tok.backend.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert tok.encode("a   12345 b", add_special_tokens=False) == tok.encode("a   ", add_special_tokens=False) + [
        tok.encode(d, add_special_tokens=False)[0] for d in "12345"
    ] + tok.encode(" b", add_special_tokens=False)


def test_decode_round_trip(default_tokenizer: Tokenizer):
    for text in TEXTS:
        if "<" in text:
            continue  # special tokens are skipped on decode
        assert default_tokenizer.decode(default_tokenizer.encode(text)) == text


def test_transformers_loads_the_written_tokenizer_files(default_model_dir: Path, default_tokenizer: Tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=True) == default_tokenizer.encode(text), text
    assert hf.eos_token_id == 2 and hf.bos_token_id == 1 and hf.pad_token == "<|im_end|>"
    assert hf.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False) == default_tokenizer.apply_chat_template(FRANCE)


def test_text_stream_uses_the_tokenizer(default_tokenizer: Tokenizer):
    stream = default_tokenizer.text_stream(stop=("Paris",))
    assert isinstance(stream, TextStream)
    ids = default_tokenizer.encode("The capital of France is Paris.<|im_end|>", add_special_tokens=False)
    out = "".join(stream.push(i) for i in ids)
    assert out == stream.text == "The capital of France is " and stream.stopped == "Paris"
    # Without a stop string, control tokens are skipped in the streamed text.
    stream = default_tokenizer.text_stream()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "The capital of France is Paris."
    assert stream.num_tokens == len(ids) and ids[-1] == 2


def _copy_tokenizer_files(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_eos_ids_union_config_files(default_model_dir: Path, tmp_path: Path):
    d = _copy_tokenizer_files(default_model_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    assert Tokenizer.from_dir(d).eos_token_ids == (2, 0, 5)


def test_chat_template_sources(default_model_dir: Path, tmp_path: Path):
    d = _copy_tokenizer_files(default_model_dir, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(d).apply_chat_template(FRANCE) == "<|im_start|>D"
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")  # a separate file wins
    assert Tokenizer.from_dir(d).apply_chat_template(FRANCE) == "J1"
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").unlink()
    tok = Tokenizer.from_dir(d)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(FRANCE)


def test_missing_files_are_named(default_model_dir: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(default_model_dir / "tokenizer.json", d / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
