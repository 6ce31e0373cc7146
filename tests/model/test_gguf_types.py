"""Every GGUF tensor type the importer reads, on a tiny random Llama written the way llama.cpp writes it.

The oracle is independent of the importer: the file is written with the gguf library's own HF -> GGUF
name map, quantizers and llama.cpp's Q/K permutation (tests/model/gguf_files.py), the expected tensors are
the library's dequantization of what was written, and the expected logits come from transformers running
those same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.model.gguf_import import BLOCK_FILES, SUPPORTED_TYPES, import_gguf
from tests.model.gguf_files import TYPES, byte_level_vocab, write_gguf

transformers = pytest.importorskip("transformers")

PROMPT = [7, 41, 200, 99, 13, 150, 77, 254, 8, 31, 120, 66, 190, 4, 222, 101]
NEW_TOKENS = 32
# Greedy agreement with the float model, teacher-forced over its 32 greedy tokens, for the types the library
# can quantize the float weights to (the K-quants it cannot write, so their files hold random blocks).
# Measured on this model: 32/32 for F16, BF16 and Q8_0; 26 and 23 for Q5_0 and Q5_1; 22 and 18 for Q4_0 and Q4_1
# (a random model's logits are flat, so this is a weak bound for the 4- and 5-bit types; their exact check is
# test_logits_equal_transformers_on_the_same_weights).
AGREEMENT = {"F16": 1.0, "BF16": 0.95, "Q8_0": 0.9, "Q5_0": 0.65, "Q5_1": 0.65, "Q4_0": 0.5, "Q4_1": 0.5}


def test_the_types_are_the_supported_ones():
    assert TYPES == SUPPORTED_TYPES


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(transformers model, config, its save_pretrained directory, prompt + its 32 greedy tokens)."""
    config = transformers.LlamaConfig(
        vocab_size=len(byte_level_vocab()["tokens"]), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)  # hidden 256: the K-quants' 256-weight blocks fit every row
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny_llama_hf")
    model.save_pretrained(directory)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return model, config, directory, out[0].tolist()


@pytest.fixture(scope="module", params=TYPES)
def imported(request, tiny_llama, tmp_path_factory):
    """(type, imported directory, reference weights) of the tiny Llama written as a GGUF of one type."""
    model, config, _, _ = tiny_llama
    qtype = request.param
    directory = tmp_path_factory.mktemp(f"gguf_{qtype}")
    reference = write_gguf(directory / f"tiny-{qtype}.gguf", model.state_dict(), config, qtype)
    out = import_gguf(directory / f"tiny-{qtype}.gguf", directory / "imported", progress=False)
    return qtype, out, reference


def test_every_tensor_is_the_librarys_dequantization(imported):
    from safetensors.numpy import load_file

    qtype, directory, reference = imported
    ours = load_file(str(directory / "model.safetensors"))
    assert set(ours) == set(reference)
    for name, want in reference.items():
        assert ours[name].dtype == np.float32 and np.array_equal(ours[name], want), name
    kept = {kind for kind, file in BLOCK_FILES.items() if (directory / file).exists()}
    assert kept == ({qtype} if qtype in BLOCK_FILES else set())


def _pagoda_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    from pagoda.model.loader import load_model

    model, _ = load_model(directory, dtype="float32", device="cpu", max_positions=64)
    with torch.no_grad():
        return model.reference_forward(torch.tensor(ids))


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_logits_equal_transformers_on_the_same_weights(imported, tiny_llama):
    """pagoda on the imported GGUF == transformers on the library's dequantization of the same file."""
    qtype, directory, reference = imported
    model, config, hf_dir, sequence = tiny_llama
    if qtype == "F32":  # the file's weights are the model's own: its save_pretrained directory, as saved
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        atol = 1e-5
    else:
        theirs = transformers.LlamaForCausalLM(config).eval()
        missing, unexpected = theirs.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()}, strict=False)
        assert not unexpected and all(k.endswith("inv_freq") for k in missing)
        atol = 1e-4
    ours, want = _pagoda_logits(directory, sequence), _hf_logits(theirs, sequence)
    assert (ours - want).abs().max() <= atol
    top2 = want.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 10 * atol  # greedy picks agree wherever the choice is not a near-tie
    assert torch.equal(ours.argmax(-1)[clear], want.argmax(-1)[clear]) and clear.float().mean() > 0.9


@pytest.mark.parametrize("qtype", sorted(AGREEMENT))
def test_greedy_agreement_with_the_float_model(qtype, tiny_llama, tmp_path):
    """The quantized file's greedy choices against the float model's, at each type's precision."""
    model, config, _, sequence = tiny_llama
    write_gguf(tmp_path / "m.gguf", model.state_dict(), config, qtype)
    logits = _pagoda_logits(import_gguf(tmp_path / "m.gguf", tmp_path / "imported", progress=False), sequence)
    picks = logits.argmax(-1)[len(PROMPT) - 1:-1].tolist()  # teacher-forced on the float model's tokens
    agreement = np.mean([a == b for a, b in zip(picks, sequence[len(PROMPT):])])
    assert agreement >= AGREEMENT[qtype], agreement


def layer_stacks(layer):
    """A layer's stacked products -> the checkpoint tensors each stacks."""
    return {
        layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        layer.self_attn.o_proj: ["self_attn.o_proj"],
        layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
        layer.mlp.down_proj: ["mlp.down_proj"],
    }


@pytest.mark.parametrize("qtype", sorted(BLOCK_FILES))
def test_the_gguf_format_multiplies_the_files_own_blocks(qtype, tiny_llama, tmp_path):
    """--quantization gguf (auto's choice for a GGUF on a CPU) takes Q4_0 / Q4_1 / Q8_0 blocks as they are: every
    layer's pack holds exactly the values the gguf package dequantizes; the tied LM head takes the embedding's
    blocks and the embedding stays for the lookup."""
    from pagoda.kernels import cpu_native
    from pagoda.model.loader import load_model
    from pagoda.model.quantize import BlockWeight, dequantize

    if not cpu_native.available():
        pytest.skip(f"{cpu_native.load()}")
    model, config, _, _ = tiny_llama
    reference = write_gguf(tmp_path / "m.gguf", model.state_dict(), config, qtype)
    directory = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", progress=False)
    ours, _ = load_model(directory, dtype="auto", device="cpu", max_positions=64, quantization="auto")  # its own
    assert ours.matmul.name == "blocks"
    for linear, parts in layer_stacks(ours.model.layers[0]).items():
        pack = linear.packed.packed
        assert linear.packed.released and isinstance(pack, BlockWeight) and pack.format == qtype.lower()
        want = torch.from_numpy(np.concatenate([reference[f"model.layers.0.{p}.weight"] for p in parts]))
        assert torch.equal(dequantize(pack), want), parts  # the file's values, not rounded again
    embedding = "model.embed_tokens.weight"
    if ours.lm_head is None and ours.model.embed_tokens.weight.numel():
        head = ours.lm_head_packed.packed
        assert isinstance(head, BlockWeight) and torch.equal(dequantize(head), torch.from_numpy(reference[embedding]))


@pytest.mark.parametrize("qtype", sorted(k for k in BLOCK_FILES if k.startswith("Q4")))
def test_int4_packs_the_files_own_4_bit_blocks(qtype, tiny_llama, tmp_path):
    """--quantization int4 takes Q4_0 / Q4_1 blocks as they are: the file's q, scales rounded to bfloat16."""
    from pagoda.model.loader import load_model
    from pagoda.model.matmul import Linear
    from pagoda.model.quantize import Int4Weight, dequantize, has_int_kernels

    if not has_int_kernels():
        pytest.skip("this torch build lacks the CPU int4 kernels")
    model, config, _, _ = tiny_llama
    reference = write_gguf(tmp_path / "m.gguf", model.state_dict(), config, qtype)
    directory = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", progress=False)
    ours, _ = load_model(directory, dtype="float32", device="cpu", max_positions=64, quantization="int4")
    for linear, parts in layer_stacks(ours.model.layers[0]).items():
        assert isinstance(linear, Linear) and linear.packed.released  # adopted from the blocks, not rounded again
        assert isinstance(linear.packed.packed, Int4Weight)
        want = torch.from_numpy(np.concatenate([reference[f"model.layers.0.{p}.weight"] for p in parts]))
        relative = (dequantize(linear.packed.packed) - want).abs().max() / want.abs().max()
        assert relative <= 0.004, (parts, relative)  # only the bfloat16 rounding of the scales


def test_a_gguf_file_serves_through_the_engine(tiny_llama, tmp_path, monkeypatch):
    """`--model FILE.gguf`: build_engine imports it into $PAGODA_HOME and greedy matches transformers."""
    from pagoda.core.sampling_params import SamplingParams
    from pagoda.model.factory import EngineOptions, build_engine

    model, config, _, _ = tiny_llama
    reference = write_gguf(tmp_path / "tiny.Q4_K.gguf", model.state_dict(), config, "Q4_K")
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()}, strict=False)
    with torch.no_grad():
        want = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    options = EngineOptions(model=str(tmp_path / "tiny.Q4_K.gguf"), device="cpu", dtype="float32", num_blocks=32,
                            max_model_len=128)
    engine, tokenizer, model_dir = build_engine(options, progress=False)
    assert model_dir.parent == tmp_path / "home" / "models" and model_dir.name.startswith("tiny.Q4_K-")
    assert tokenizer.encode_chat([{"role": "user", "content": "the"}])[:2] == [1, tokenizer.encode("user")[0]]
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    assert got == want


def test_int4_from_mixed_q4_0_and_q4_1_blocks():
    """A stacked weight whose parts are Q4_0 and Q4_1 (q/k/v of one layer) packs from both, q as stored."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    from pagoda.model.quantize import dequantize, has_int_kernels, int4_from_gguf_blocks, int4_values

    if not has_int_kernels():
        pytest.skip("this torch build lacks the CPU int4 kernels")
    rng = np.random.default_rng(0)
    parts, want, codes = [], [], []
    for kind, rows in ((GGMLQuantizationType.Q4_0, 32), (GGMLQuantizationType.Q4_1, 16)):
        w = rng.standard_normal((rows, 64)).astype(np.float32)
        blocks = quantize(w, kind)
        parts.append(torch.from_numpy(blocks.reshape(rows, 2, -1)))
        want.append(gguf_dequantize(blocks, kind).reshape(rows, 64))
        qs = torch.from_numpy(blocks.reshape(rows, 2, -1)[..., -16:].astype(np.int32))
        codes.append(torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, 64))
    packed = int4_from_gguf_blocks(parts)
    assert torch.equal(int4_values(packed), torch.cat(codes).float())  # the file's q, not rounded again
    expected = torch.from_numpy(np.concatenate(want))
    assert (dequantize(packed) - expected).abs().max() <= 0.004 * expected.abs().max()
