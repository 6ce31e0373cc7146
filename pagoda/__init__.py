"""pagoda: an LLM inference engine with a paged KV cache, continuous batching and pluggable protocols."""

__version__ = "0.1.0"
