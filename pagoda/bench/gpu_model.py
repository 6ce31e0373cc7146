"""Random-weight models of a real shape as Hugging Face directories, for machines that can download nothing.

    python -m pagoda.bench.gpu_model OUT_DIR [--shape smollm2-135m] [--vocab N] [--dtype bfloat16]

A directory holds config.json (the Llama architecture, the shape's `NAMED_CONFIGS` entry), model.safetensors
(seeded normal weights, scaled as tests/server_fixtures.py scales its tiny model so greedy argmaxes are far from
ties), and a tokenizer made here with the `tokenizers` library: byte-level BPE trained on a paragraph of text,
with ChatML's special tokens and chat template. The model's vocabulary is the tokenizer's unless `--vocab`
asks for more (the ids past the tokenizer's decode to nothing). `pagoda serve --model OUT_DIR` and
`pagoda bench offline --model OUT_DIR` read it like any downloaded model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from pagoda.model.config import NAMED_CONFIGS, ModelConfig, named_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged key-value cache keeps the keys and values of every "
    "sequence in fixed-size blocks, so that memory is allocated as the sequence grows and shared between requests "
    "with equal prefixes. Continuous batching admits new requests at every step, while chunked prefill cuts long "
    "prompts so that decoding requests keep their pace. Hello, world! What is the capital of France? Paris. "
    "Write a haiku about the sea: waves fold into foam, the tide forgets its own name, salt remembers it. "
    "def main():\n    print('hello')\n    return 0\n{\"name\": \"value\", \"numbers\": [1, 2, 3]}\n"
)


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) with ChatML's specials; trained here, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT] * 4, trainer=trainer)
    return tokenizer


def write_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """tokenizer.json and tokenizer_config.json in `out`; returns the tokenizer's vocabulary size."""
    tokenizer = make_tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "unk_token": None, "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 8192,
    }))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def config_json(c: ModelConfig, dtype: torch.dtype, eos_token_id: int) -> dict:
    """A Llama config.json of shape `c`."""
    raw = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if c.rope_scaling is not None:
        s = c.rope_scaling
        raw["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position_embeddings}
    return raw


def random_weights(c: ModelConfig, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Hugging Face-named weights of shape `c` (untied LM head), drawn on `device`, returned on the CPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, hd = c.hidden_size, c.head_dim

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        # std 0.5 (divided by sqrt(fan-in) for the layers): a peaked distribution, greedy argmaxes far from ties
        return (torch.randn(*shape, generator=g, device=device) * (0.5 * scale)).to(dtype).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {"model.embed_tokens.weight": rand(c.vocab_size, h), "model.norm.weight": ones(h),
               "lm_head.weight": rand(c.vocab_size, h, scale=h**-0.5 * 4)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(c.num_attention_heads * hd, h, scale=h**-0.5),
            p + "self_attn.k_proj.weight": rand(c.num_key_value_heads * hd, h, scale=h**-0.5),
            p + "self_attn.v_proj.weight": rand(c.num_key_value_heads * hd, h, scale=h**-0.5),
            p + "self_attn.o_proj.weight": rand(h, c.num_attention_heads * hd, scale=h**-0.5),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, h, scale=h**-0.5),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, h, scale=h**-0.5),
            p + "mlp.down_proj.weight": rand(h, c.intermediate_size, scale=c.intermediate_size**-0.5),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
    return tensors


def write_model_dir(out: Path | str, shape: str = "smollm2-135m", *, vocab: int | None = None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu",
                    **overrides) -> Path:
    """A Hugging Face directory of the named shape with random weights and a tokenizer made here."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_tokenizer(out)
    c = replace(named_config(shape, **overrides), vocab_size=max(vocab or 0, tokenizer_vocab))
    eos = SPECIAL_TOKENS.index("<|im_end|>")  # trained first, so the specials hold ids 0, 1, 2
    (out / "config.json").write_text(json.dumps(config_json(c, dtype, eos), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_file(random_weights(c, dtype, seed, device), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.gpu_model", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shape", default="smollm2-135m", choices=[n for n in NAMED_CONFIGS])
    p.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (at least the tokenizer's)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where weights are drawn")
    args = p.parse_args(argv)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    path = write_model_dir(args.out, args.shape, vocab=args.vocab, dtype=getattr(torch, args.dtype), seed=args.seed,
                           device=args.device, **overrides)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
