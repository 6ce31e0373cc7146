"""The two checks every architecture plugin passes, written once.

1. Against transformers' own class: a small random config of the family's real shape, saved with
   `save_pretrained` (nothing is downloaded), loaded by pagoda in float32 on the exact path; the prompt's
   logits must be close at every position and the greedy tokens equal.
2. Batch invariance: the same request alone, in a crowd of eight, and preempted and recomputed gives the
   same tokens and bit-identical logits (tests/model/test_batch_invariance.py's `check_invariance`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagoda.core.engine_config import EngineConfig
from pagoda.core.sampling_params import SamplingParams
from pagoda.model.factory import make_engine
from pagoda.model.loader import load_model
from tests.model.test_batch_invariance import GREEDY, SAMPLED, check_invariance
from tests.model.test_llama import empty_caches, paged_step


def save_random_hf(tmp_path: Path, config_cls: Any, model_cls: Any, name: str = "m", std: float = 0.05,
                   **config: Any) -> tuple[Any, Path]:
    """A random HF model of `config`, every weight perturbed (HF's init leaves norms at one, biases at zero)."""
    torch.manual_seed(0)
    hf = model_cls(config_cls(**config)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * std)
    hf.save_pretrained(tmp_path / name)
    return hf, tmp_path / name


def check_matches_transformers(hf: Any, model_dir: Path, *, num_tokens: int = 40, new_tokens: int = 16,
                               atol: float = 1e-4, architectures: Any = None) -> Any:
    """Prompt logits close at every position (paged, in chunks), and greedy decoding token for token."""
    model, config = load_model(model_dir, "float32", "cpu", architectures=architectures)
    ids = torch.randint(3, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = paged_step(model, empty_caches(model), [(ids, 0, list(range(num_tokens // 4 + 1)))])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=atol, atol=atol)

    prompt = ids[:12]
    expected: list[int] = []  # transformers' argmax, step by step (generate() would suppress an early EOS)
    with torch.no_grad():
        for _ in range(new_tokens):
            expected.append(int(hf(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    engine = make_engine(model, EngineConfig(num_blocks=64, block_size=4, max_running=4, max_batched_tokens=64,
                                             max_model_len=256))
    engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    assert got == expected, f"greedy tokens differ from transformers: {got} != {expected}"
    return model


def check_batch_invariance(model_dir: Path, *, tight_blocks: int = 24) -> None:
    """Alone == in a crowd == preempted, bit for bit, for a greedy and a sampled request."""
    model, config = load_model(model_dir, "float32", "cpu", max_positions=512)
    gen = torch.Generator().manual_seed(11)
    targets = [("greedy", torch.randint(3, config.vocab_size, (13,), generator=gen).tolist(), GREEDY),
               ("sampled", torch.randint(3, config.vocab_size, (22,), generator=gen).tolist(), SAMPLED)]
    check_invariance(model, targets, tight_blocks=tight_blocks)
