"""The default model through pagoda against HF transformers reading the same GGUF file.

transformers dequantizes the GGUF itself and runs its own Llama: the same
weights through an independent implementation. Tolerance for prompt logits:
max |pagoda - transformers| <= 1e-3 absolute over every position and every
vocabulary entry (logits reach ~38; both run float32 and differ only in
summation order across 30 layers; measured 1.2e-4).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.batch import ScheduledChunk, SchedulerOutput
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.loader import load_model
from pagoda.model.runner import StepPlan
from tests.model_fixtures import default_gguf_path, default_model_dir, default_tokenizer  # noqa: F401

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-3
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "Give me three tips for learning a new language, with an example for each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between cats and dogs as pets?",
]


@pytest.fixture(scope="module")
def hf_model(default_gguf_path):  # noqa: F811
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def pagoda_engine(default_model_dir):  # noqa: F811
    """One engine for the module; the prompt-logits helper drives its runner directly while it is idle."""
    model, _ = load_model(default_model_dir, "float32", "cpu", max_positions=1024)
    config = EngineConfig(num_blocks=256, block_size=16, max_running=8, max_batched_tokens=256, max_model_len=1024)
    return make_engine(model, config, eos_token_ids=(2,))


def pagoda_prompt_logits(runner, ids):
    """Logits [T, V] of every prompt position through the runner's paged path."""
    request = Request("p", list(ids), SamplingParams())
    table = tuple(range(-(-len(ids) // runner.block_size)))
    inputs = runner.prepare(StepPlan.of(SchedulerOutput([ScheduledChunk(request, 0, len(ids), table)], runner.block_size)))
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.ctx)
        return runner.model.compute_logits(hidden[: len(ids)])


def pagoda_greedy(engine, prompts, max_tokens):
    """Greedy outputs of all prompts, run together through the (idle) engine."""
    out = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def hf_greedy(hf_model, ids, max_tokens):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=2, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_capital_of_france_matches_transformers(hf_model, pagoda_engine, default_tokenizer):  # noqa: F811
    ids = default_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert len(ids) == 37 and ids[:10] == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
    ours = pagoda_prompt_logits(pagoda_engine.runner, ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape == (37, 49152)
    assert (ours - theirs).abs().max().item() <= LOGITS_ATOL
    (tokens,) = pagoda_greedy(pagoda_engine, [ids], 16)
    assert tokens == hf_greedy(hf_model, ids, 16)
    assert default_tokenizer.decode(tokens, skip_special_tokens=False) == "The capital of France is Paris.<|im_end|>"


@pytest.mark.slow
def test_chat_prompts_greedy_match_transformers_for_32_tokens(hf_model, pagoda_engine, default_tokenizer):  # noqa: F811
    prompts = [default_tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = pagoda_greedy(pagoda_engine, prompts, 32)
    for ids, tokens in zip(prompts, ours):
        assert len(tokens) == 32  # each answer is long enough to compare 32 tokens
        assert tokens == hf_greedy(hf_model, ids, 32)
        logits = pagoda_prompt_logits(pagoda_engine.runner, ids)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0]
        assert (logits - theirs).abs().max().item() <= LOGITS_ATOL


PROMPT_LOGPROBS_ATOL = 1e-4  # both float32; measured 2.9e-5 at most on the prompts below


def pagoda_prompt_logprobs(engine, prompts, k):
    """Each prompt's prompt logprobs through the engine, scored together (max_tokens 0)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"score{i}", ids, SamplingParams(max_tokens=0, prompt_logprobs=k))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None and o.new_token_ids == [], o
            out[o.request_id] = o.prompt_logprobs
    engine.audit()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [out[f"score{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("max_batched_tokens, cached", [(256, False), (256, True), (7, False), (7, True)],
                         ids=["whole", "whole-cached", "chunked", "chunked-cached"])
def test_prompt_logprobs_match_transformers(hf_model, default_model_dir, default_tokenizer,  # noqa: F811
                                            max_batched_tokens, cached):
    """Every position's logprob of the next prompt token and its top 3 equal transformers' log_softmax over the same
    prompt, in chunks of 7 tokens or whole; `cached`: the prompts' blocks are in the prefix cache first (a request
    that reads it proves it), and scoring still computes every position."""
    model, _ = load_model(default_model_dir, "float32", "cpu", max_positions=1024, quantization="none")
    config = EngineConfig(num_blocks=256, block_size=16, max_running=8, max_batched_tokens=max_batched_tokens,
                          max_model_len=1024)
    engine = make_engine(model, config, eos_token_ids=(2,))
    prompts = [default_tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    prompts.append(default_tokenizer.encode(" ".join(PROMPTS)))  # a plain text, several blocks long
    if cached:
        pagoda_greedy(engine, prompts, 1)
        reader = engine.add_request("reader", prompts[0], SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        assert reader.num_cached_tokens >= 32, "the prefix cache held nothing: the test proved less"
    for ids, ours in zip(prompts, pagoda_prompt_logprobs(engine, prompts, 3)):
        with torch.no_grad():
            theirs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        assert [t.token_id for t in ours] == ids and ours[0].logprob is None
        for position, entry in enumerate(ours[1:], start=1):
            row = theirs[position - 1]
            assert abs(entry.logprob - row[ids[position]].item()) <= PROMPT_LOGPROBS_ATOL, position
            assert len(entry.top_logprobs) == 3
            for token_id, logprob in entry.top_logprobs:
                assert abs(logprob - row[token_id].item()) <= PROMPT_LOGPROBS_ATOL, (position, token_id)
            assert row.topk(3).values[-1].item() <= entry.top_logprobs[-1][1] + PROMPT_LOGPROBS_ATOL  # truly the top


def test_generate_command_answers_paris(default_model_dir, monkeypatch, capsys):  # noqa: F811
    from pagoda.cli.main import main

    monkeypatch.setenv("PAGODA_HOME", str(default_model_dir.parent.parent))  # the fixture's imported model
    # the exact path: the float32 weights transformers runs (the default multiplies the file's Q4_1 blocks, and
    # answers as llama.cpp's server does on that file: docs/performance.md)
    argv = ["generate", "What is the capital of France?", "--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--quantization", "none"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "The capital of France is Paris."
    assert "tokens/s" in err


@pytest.fixture(scope="module")
def hf_answers(hf_model, default_tokenizer):  # noqa: F811
    """Per prompt: (prompt + transformers' greedy answer, the answer, transformers' logprobs [T, V])."""
    out = []
    for text in PROMPTS:
        ids = default_tokenizer.encode_chat([{"role": "user", "content": text}])
        answer = hf_greedy(hf_model, ids, 32)
        full = ids + answer
        with torch.no_grad():
            out.append((full, answer, torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), -1)))
    return out


def format_quality(hf_answers, runner):
    """A weight format against transformers' float32, teacher-forced on transformers' greedy answers.

    Returns (greedy agreement: the share of answer positions where the format's argmax is
    transformers' token, mean |delta logprob| of transformers' token over those positions).
    """
    agree, deltas = [], []
    for full, answer, theirs in hf_answers:
        ours = torch.log_softmax(pagoda_prompt_logits(runner, full), -1)
        rows = torch.arange(len(full) - len(answer) - 1, len(full) - 1)  # the position before each answer token
        target = torch.tensor(answer)
        agree += (ours[rows].argmax(-1) == target).tolist()
        deltas += (ours[rows, target] - theirs[rows, target]).abs().tolist()
    return sum(agree) / len(agree), sum(deltas) / len(deltas)


def without_q4_1_blocks(model_dir, tmp_path):
    """The import's directory minus its Q4_1 blocks: int4 is then rounded from the float32 weights."""
    from pagoda.model.gguf_import import Q4_1_BLOCKS_FILE

    for f in model_dir.iterdir():
        if f.name != Q4_1_BLOCKS_FILE:
            (tmp_path / f.name).symlink_to(f)
    return tmp_path


# name: (dtype, quantization, LM head format, int4 from the GGUF's own blocks, min agreement, max mean delta)
# for every format that changes the numbers.
# Bounds catch a broken format, not noise; docs/performance.md ("Weight formats") records the measured values.
FORMATS = {
    "gguf": ("float32", "gguf", None, True, 0.9, 0.15),  # the default: the file's Q4_1 layers and Q8_0 head
    "w8a8": ("float32", "w8a8", None, False, 0.9, 0.15),
    "bfloat16": ("bfloat16", "none", None, False, 0.9, 0.1),
    "int8": ("float32", "int8", "int8", False, 0.9, 0.15),
    "int8-float-head": ("float32", "int8", "float", False, 0.9, 0.15),
    "int4-q4_1": ("float32", "int4", "int8", True, 0.9, 0.15),
    "int4-q4_1-float-head": ("float32", "int4", "float", True, 0.9, 0.1),
    "int4-q4_1-int4-head": ("float32", "int4", "int4", True, 0.75, 0.3),
    "int4-rtn": ("float32", "int4", "int8", False, 0.9, 0.15),
    "int4-rtn-float-head": ("float32", "int4", "float", False, 0.9, 0.1),
    "int4-rtn-int4-head": ("float32", "int4", "int4", False, 0.75, 0.3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_weight_formats_stay_close_to_transformers_float32(name, hf_answers, default_model_dir, tmp_path):  # noqa: F811
    from pagoda.kernels import cpu_native
    from pagoda.model.loader import weight_format
    from pagoda.model.matmul import ONEDNN_BF16
    from pagoda.model.quantize import has_int_kernels

    dtype, quantization, lm_head, from_blocks, min_agreement, max_delta = FORMATS[name]
    if quantization in ("gguf", "w8a8") and not cpu_native.available():
        pytest.skip(f"{cpu_native.load()}")
    if quantization in ("int8", "int4") and not has_int_kernels():
        pytest.skip("torch lacks the CPU int8/int4 weight kernels")
    model_dir = default_model_dir if from_blocks else without_q4_1_blocks(default_model_dir, tmp_path)
    model, _ = load_model(model_dir, dtype, "cpu", max_positions=1024, quantization=quantization,
                          lm_head=lm_head)
    if dtype == "bfloat16" and model.matmul is not ONEDNN_BF16:
        pytest.skip("no native bfloat16 products on this CPU")
    config = EngineConfig(num_blocks=256, block_size=16, max_running=8, max_batched_tokens=256, max_model_len=1024)
    engine = make_engine(model, config, eos_token_ids=(2,))
    agreement, mean_delta = format_quality(hf_answers, engine.runner)
    print(f"{name} ({weight_format(model)}): greedy agreement {agreement:.3f}, mean |delta logprob| {mean_delta:.4f}")
    assert agreement >= min_agreement and mean_delta <= max_delta, (agreement, mean_delta)
