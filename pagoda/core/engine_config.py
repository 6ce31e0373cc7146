"""Engine configuration: the pool, the batch limits and the context length.

The field defaults are the project's defaults, written here only: `EngineOptions`
(`pagoda/model/factory.py`) and the command line read them as `EngineConfig.block_size` etc.
The model runner sizes its KV cache from the same config the scheduler's pool follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) drafts for greedy requests (core/speculative.py), and the rows a step may give them:
    the rows the runner pads anyway, plus at most `max_extra_rows` more (0: a draft never makes a step bigger)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # most drafts one request gets in a step
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up earlier in the request's tokens
    prompt_lookup_min: int = 1  # the shortest
    max_extra_rows: int = 0  # token (and LM-head) rows a step may add for drafts beyond its runner's padding

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram', got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_extra_rows, int) or isinstance(self.max_extra_rows, bool) or self.max_extra_rows < 0:
            raise ValueError(f"speculative_config.max_extra_rows must be an integer >= 0, got {self.max_extra_rows!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds"
                             f" prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The command line's JSON (vLLM's `--speculative-config`); '{}', 'none' or 'null' turn speculation off."""
        if text.strip().lower() in ("none", "null", "off", ""):
            return None
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
        if not fields:
            return None
        unknown = sorted(fields.keys() - cls.__dataclass_fields__.keys())
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}")
        return cls(**fields)


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_running: int = 64  # sequences in one step
    max_batched_tokens: int = 512  # new tokens in one step (prefill chunks + decodes)
    max_model_len: int = 8192  # prompt + output tokens of one request
    enable_prefix_caching: bool = True  # share computed full blocks between requests with equal prefixes
    max_waiting: int | None = None  # requests the waiting queue may hold; a new one beyond is refused (QueueFull)
    # n-gram drafts for greedy requests, in the rows the runner's padding would waste (by default never a bigger
    # step); None = off. Whether they can run also depends on the runner's row multiple: Scheduler.speculation.
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    # who is admitted, gets the step's tokens and is preempted: a registered SchedulingPolicy's name (core/scheduling.py)
    scheduling_policy: str = "fcfs"
    # each row's bits the same whatever the batch (the CPU runner proves its products at start-up and caps their
    # calls' rows, pagoda/model/invariance.py); False: the fastest kernels, answers may depend on the batch
    batch_invariant: bool = True
    # decode-only steps replay CUDA graphs captured at start-up (pagoda/model/cuda_graphs.py); CUDA only: elsewhere
    # the runner says why not and runs every step eagerly
    cuda_graphs: bool = False
    # decode-only steps on a CPU replay a recorded step in one native call (pagoda/model/cpu_graphs.py), where
    # every kernel of the step is pagoda's own (the int8 and GGUF-block formats); elsewhere they run eagerly
    cpu_graphs: bool = True
    # LoRA adapters (pagoda/model/lora.py): at most `max_loras` distinct adapters have rows in one step (base rows
    # count none; a waiting request whose adapter would exceed it waits, core/scheduler.py); an adapter of a rank
    # above `max_lora_rank` is refused when it is loaded. vLLM's defaults.
    max_loras: int = 1
    max_lora_rank: int = 16
    # adapters are expected (at start-up or loaded live): CPU step graphs are recorded with a LoRA node after each
    # adaptable product, so that steps with adapter rows replay too (without, such steps run eagerly)
    enable_lora: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_running", "max_batched_tokens", "max_model_len", "max_loras",
                     "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("enable_prefix_caching", "batch_invariant", "cuda_graphs", "cpu_graphs", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or isinstance(self.max_waiting, bool)
                                             or self.max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {self.max_waiting!r}")
        if not isinstance(self.scheduling_policy, str) or not self.scheduling_policy:
            raise ValueError(f"scheduling_policy must be a policy's name, got {self.scheduling_policy!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size
