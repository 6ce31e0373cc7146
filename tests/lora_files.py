"""Random LoRA adapters made by the `peft` library itself, for the tests (nothing is downloaded).

`save_random_adapter` wraps a transformers model of the base's shapes in peft's LoRA (B drawn at random, not
peft's zeros, so the adapter changes the answer) and saves it as a PEFT directory; `adapted_hf` loads one
over a transformers model, as a user of peft would, for the logits it must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapter(base: Any, directory: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                        targets: tuple[str, ...] = ALL_LINEARS, rslora: bool = False, std: float = 0.05) -> Path:
    """A PEFT LoRA directory for `base` (a transformers model, left unchanged) of random A and B."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * std)
    peft_model.save_pretrained(str(directory))
    return Path(directory)


def adapted_hf(base: Any, directory: Path) -> Any:
    """peft's own model of `base` with the adapter at `directory` (a copy of `base`)."""
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()


def edit_config(directory: Path, **fields: Any) -> None:
    """Change fields of an adapter's adapter_config.json (a malformed adapter)."""
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def hf_model(model_dir: Path) -> Any:
    """transformers' own model of a Hugging Face directory, in float32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
