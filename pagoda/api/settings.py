"""What the HTTP server is told at start-up (besides the engine and the plugins)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.plugins.request_fields import DEFAULT_LIMITS, RequestLimits


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"  # where `pagoda serve` listens
    port: int = 8000  # 0 = a port the kernel picks (printed)
    log_level: str = "info"
    disabled_plugins: tuple[str, ...] = ()  # plugins left out (--disable-plugin; also PAGODA_DISABLE_PLUGINS)
    served_model_name: str = "default"  # the model name responses report and /v1/models lists
    api_key: str | None = None  # None = no key needed (unless api_keys_file names some); else one tenant, "default"
    api_keys_file: str | None = None  # tenants, keys and limits (pagoda.api.keys_file); re-read on SIGHUP
    disconnect_policy: str = "abort"  # a registered DisconnectPolicy's name
    tool_parser: str | None = "hermes"  # a registered ToolParser's name: the model's tool-call syntax; None = no tools
    send_stall_timeout: float = 2.0  # seconds a stream may make no write progress before its client counts as gone
    send_buffer_size: int | None = None  # bytes of SO_SNDBUF per connection; None = the kernel's autotuning
    health_timeout: float = 10.0  # seconds a step may run before /health calls the engine loop stuck (503)
    max_body_bytes: int = 8 * 1024 * 1024  # a bigger request body is refused with 413
    max_header_bytes: int = 32 * 1024  # request headers (names + values) beyond this are refused with 431
    shutdown_timeout: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    # Seconds a request may take to arrive whole (headers and body), from its first byte or the connection's
    # opening; then 408 and the connection closes (docs/reliability.md, "Slow clients").
    request_read_timeout: float = 30.0
    max_connections: int | None = None  # connections served at once; a request on one more gets 503; None = no cap
    # The model's sampling defaults (generation_config.json; --generation-config none: {}), for the sampling
    # fields a request leaves null (pagoda.api.generation.with_generation_defaults).
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    served_model_aliases: tuple[str, ...] = ()  # more names a request may ask for (--served-model-name A B ...)
    refuse_unknown_models: bool = True  # a request naming another model gets 404 model_not_found
    allowed_origins: tuple[str, ...] = ()  # origins a browser may call from (CORS); none by default
    request_limits: RequestLimits = DEFAULT_LIMITS  # stop strings, logprobs, max_tokens of one request
    # --enable-lora-loading: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (pagoda.api.adapters)
    enable_lora_loading: bool = False
    # (adapter name, parent) of the --lora-modules given vLLM's `base_model_name`: the parent its card names (the
    # others' is the served name)
    lora_parents: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port!r}")
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.disconnect_policy, str) or not self.disconnect_policy:
            raise ValueError("disconnect_policy must be a non-empty string")
        if self.tool_parser is not None and (not isinstance(self.tool_parser, str) or not self.tool_parser):
            raise ValueError("tool_parser must be a non-empty string or None")
        if not self.send_stall_timeout > 0:
            raise ValueError(f"send_stall_timeout must be > 0 seconds, got {self.send_stall_timeout}")
        if self.send_buffer_size is not None and (not isinstance(self.send_buffer_size, int)
                                                  or self.send_buffer_size < 1):
            raise ValueError(f"send_buffer_size must be a positive number of bytes, got {self.send_buffer_size}")
        if not self.health_timeout > 0:
            raise ValueError(f"health_timeout must be > 0 seconds, got {self.health_timeout}")
        for name in ("max_body_bytes", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if not all(isinstance(n, str) and n for n in self.served_model_aliases):
            raise ValueError("served_model_aliases must be non-empty strings")
        if not all(isinstance(o, str) and o for o in self.allowed_origins):
            raise ValueError("allowed_origins must be non-empty strings (an origin such as https://example.com, or *)")
        if not self.request_read_timeout > 0:
            raise ValueError(f"request_read_timeout must be > 0 seconds, got {self.request_read_timeout}")
        if self.max_connections is not None and (not isinstance(self.max_connections, int)
                                                 or isinstance(self.max_connections, bool) or self.max_connections < 1):
            raise ValueError(f"max_connections must be a positive number or None, got {self.max_connections!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
