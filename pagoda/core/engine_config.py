"""Engine configuration: the pool, the batch limits and the context length.

The field defaults are the project's defaults, written here only: `EngineOptions`
(`pagoda/model/factory.py`) and the command line read them as `EngineConfig.block_size` etc.
The model runner sizes its KV cache from the same config the scheduler's pool follows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_running: int = 64  # sequences in one step
    max_batched_tokens: int = 512  # new tokens in one step (prefill chunks + decodes)
    max_model_len: int = 8192  # prompt + output tokens of one request
    enable_prefix_caching: bool = True  # share computed full blocks between requests with equal prefixes
    max_waiting: int | None = None  # requests the waiting queue may hold; a new one beyond is refused (QueueFull)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_running", "max_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or isinstance(self.max_waiting, bool)
                                             or self.max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {self.max_waiting!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size
