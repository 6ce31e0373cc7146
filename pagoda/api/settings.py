"""What the HTTP server is told at start-up (besides the engine and the plugins)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeSettings:
    served_model_name: str = "default"  # the model name responses report and /v1/models lists
    api_key: str | None = None  # None = no key needed
    disconnect_policy: str = "abort"  # a registered DisconnectPolicy's name
    send_stall_timeout: float = 2.0  # seconds a stream may make no write progress before its client counts as gone
    send_buffer_size: int | None = None  # bytes of SO_SNDBUF per connection; None = the kernel's autotuning
    health_timeout: float = 10.0  # seconds /health waits for the engine loop before answering 503

    def __post_init__(self) -> None:
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.disconnect_policy, str) or not self.disconnect_policy:
            raise ValueError("disconnect_policy must be a non-empty string")
        if not self.send_stall_timeout > 0:
            raise ValueError(f"send_stall_timeout must be > 0 seconds, got {self.send_stall_timeout}")
        if self.send_buffer_size is not None and (not isinstance(self.send_buffer_size, int)
                                                  or self.send_buffer_size < 1):
            raise ValueError(f"send_buffer_size must be a positive number of bytes, got {self.send_buffer_size}")
        if not self.health_timeout > 0:
            raise ValueError(f"health_timeout must be > 0 seconds, got {self.health_timeout}")
