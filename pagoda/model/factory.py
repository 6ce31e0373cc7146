"""Engine assembly, written once: model directory -> model -> runner -> Engine.

- `build_engine(options)`: from `--model default|PATH` and the engine options (what `pagoda serve`
  and the live-server harness call); returns the engine, its tokenizer and the model directory.
- `load_engine(model_dir, tokenizer, options)`: the same from a resolved directory and a loaded
  tokenizer (`pagoda generate`, which needs the tokenizer to size the pool for its prompt).
- `make_engine(model, config)`: an Engine over a model already built (random-weight benchmarks
  and tests); the runner's KV pool is the config's, given once.
- `engine_config(options, model_config, kv_dtype, device)`: the EngineConfig the options make for a
  model (the context and the pool sized from memory where the options leave them open).
- The options' LoRA adapters (`--lora-modules NAME=PATH`) are loaded by `load_engine` once the engine is built,
  through `Engine.load_adapter` (which a tensor-parallel runner hands every rank); a refused one closes the
  engine and raises AdapterError naming the adapter and its field.
- `load_shard(model_dir, options, group)` (pagoda/model/loader.py): one rank's part of the model (all of it
  alone), which rank 0 and the worker ranks of a tensor-parallel group load alike (pagoda/model/ranks.py).

With --tensor-parallel-size N (or under torchrun) `load_engine` forms the group first, as its rank 0,
and the engine runs on a `TensorParallelRunner`; `Engine.close()` ends the group.

The pool and batch defaults are `EngineConfig`'s field defaults; `EngineOptions` and the command
line read them from there. Every engine made here runs on the process's CPU set-up
(pagoda/core/machine.py: `configure_threads`), the same for the server, the library, the tests and
the benchmarks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.core.adapters import AdapterError, check_adapter_name
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig
from pagoda.core.machine import configure_threads
from pagoda.core.scheduling import SchedulingPolicy, make_policy
from pagoda.core.tokenizer import Tokenizer
from pagoda.distributed.group import SOLO, TensorGroup
from pagoda.model.ranks import ParallelOptions, Ranks, WorkerSpec, group_size
from pagoda.kernels import AttentionBackend
from pagoda.model.architectures import Architectures, builtin_architectures, read_config
from pagoda.model.config import ModelConfig
from pagoda.model.llama import Transformer
from pagoda.model.loader import context_length, load_shard
from pagoda.model.runner import TensorParallelRunner, TorchModelRunner, auto_num_blocks
from pagoda.model.shard import ShardPlan

logger = logging.getLogger("pagoda.model")


@dataclass(frozen=True)
class EngineOptions:
    """The model and engine options of `pagoda serve` (None = decided from the model and memory)."""

    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"  # --quantization: the linear layers' weight format (auto: a GGUF's own blocks on a CPU)
    block_size: int = EngineConfig.block_size
    num_blocks: int | None = None
    max_running: int = EngineConfig.max_running
    max_batched_tokens: int = EngineConfig.max_batched_tokens
    max_model_len: int | None = None
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching  # --no-prefix-caching turns it off
    max_waiting: int | None = EngineConfig.max_waiting  # --max-waiting: a fuller queue refuses new requests (429)
    # --speculative-config: n-gram drafts in the padded rows (on by default, as EngineConfig's); None = off
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    tensor_parallel_size: int = 1  # --tensor-parallel-size: ranks holding one model's shards
    distributed_backend: str | None = None  # --distributed-backend gloo|nccl (None: by the device)
    distributed_timeout: float = 60.0  # --distributed-timeout: seconds a collective may wait for a rank
    # the architecture plugins the model is looked up in (pagoda serve's: built-in and installed, less the disabled
    # ones); None: the built-in families. Picklable, so a spawned rank loads its shard through the same plugin.
    architectures: Architectures | None = None
    # --scheduling-policy: a policy's name, looked up in `scheduling_policies` (the plugins' classes, by name;
    # None: the built-in ones). Only rank 0 schedules, but the classes are module-level, so the options pickle.
    scheduling_policy: str = EngineConfig.scheduling_policy
    scheduling_policies: Mapping[str, type[SchedulingPolicy]] | None = None
    # --batch-invariant / --no-batch-invariant; None: on for the CPU, off for CUDA (its invariant kernels cost time)
    batch_invariant: bool | None = None
    cuda_graphs: bool = EngineConfig.cuda_graphs  # --cuda-graphs: decode-only steps replay CUDA graphs (CUDA only)
    cpu_graphs: bool = EngineConfig.cpu_graphs  # --no-cpu-graphs: every CPU step eagerly (pagoda/model/cpu_graphs.py)
    # --lora-modules NAME=PATH...: PEFT adapter directories loaded at start-up, each served as the model NAME
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = EngineConfig.max_loras  # --max-loras: distinct adapters with rows in one step
    max_lora_rank: int = EngineConfig.max_lora_rank  # --max-lora-rank: a higher-rank adapter is refused at load
    # --enable-lora-loading: adapters may come while serving; with --lora-modules, the engine expects adapters
    # (EngineConfig.enable_lora: CPU step graphs replay their rows)
    enable_lora_loading: bool = False

    def invariant_on(self, device: torch.device) -> bool:
        """Whether answers must not depend on the batch, on this device."""
        return self.batch_invariant if self.batch_invariant is not None else device.type == "cpu"

    @property
    def parallel(self) -> ParallelOptions:
        return ParallelOptions(self.tensor_parallel_size, self.distributed_backend, self.distributed_timeout)

    def __post_init__(self) -> None:
        from pagoda.model.matmul import QUANTIZATIONS

        self.parallel  # noqa: B018  (validates the three distributed options)

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        for name in ("block_size", "max_running", "max_batched_tokens", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_blocks", "max_model_len", "max_waiting"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        make_policy(self.scheduling_policy, self.scheduling_policies)  # an unknown name is refused now
        names = [name for name, _ in self.lora_modules]
        for name in names:
            try:
                check_adapter_name(name)  # (the served names are the server's: pagoda.api checks them)
            except AdapterError as exc:
                raise AdapterError(f"lora_modules: {exc}", exc.field) from None
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"lora_modules: the adapter name {twice!r} is given twice")


def make_engine(model: Transformer, config: EngineConfig, *, eos_token_ids: tuple[int, ...] = (),
                tokenizer: Tokenizer | None = None, backend: AttentionBackend | None = None,
                ranks: Ranks | None = None,
                policies: Mapping[str, type[SchedulingPolicy]] | None = None) -> Engine:
    """An Engine over a built model, its runner's KV pool sized by `config` (on the group of `ranks`, if given);
    `config.scheduling_policy` is looked up in `policies` (None: the built-in ones)."""
    configure_threads()
    runner = (TorchModelRunner(model, config, backend=backend) if ranks is None
              else TensorParallelRunner(model, config, ranks, backend=backend))
    engine = Engine(runner, config, eos_token_ids=eos_token_ids, tokenizer=tokenizer, policies=policies)
    logger.info("speculative decoding %s", engine.speculation.reason)
    logger.info("batch invariance %s", runner.invariance.summary())
    if config.cuda_graphs or runner.device.type == "cpu":  # asked for: say whether they run, and why not
        kind = "CPU step graphs" if runner.device.type == "cpu" else "CUDA graphs"
        (logger.info if runner.graphs is not None or not config.cuda_graphs else logger.warning)(
            "%s %s", kind, runner.graphs_summary)
    return engine


def engine_config(options: EngineOptions, model_config: ModelConfig, kv_dtype: torch.dtype,
                  device: torch.device) -> EngineConfig:
    """The engine's configuration for this model: the options, the model's context where they name none, the
    KV pool sized from free memory where they give no --num-blocks."""
    max_model_len = context_length(options, model_config)
    num_blocks = options.num_blocks or auto_num_blocks(model_config, options.block_size, kv_dtype, device,
                                                       max_model_len=max_model_len)
    return EngineConfig(num_blocks=num_blocks, block_size=options.block_size, max_running=options.max_running,
                        max_batched_tokens=options.max_batched_tokens, max_model_len=max_model_len,
                        enable_prefix_caching=options.enable_prefix_caching, max_waiting=options.max_waiting,
                        speculative=options.speculative, scheduling_policy=options.scheduling_policy,
                        batch_invariant=options.invariant_on(device), cuda_graphs=options.cuda_graphs,
                        cpu_graphs=options.cpu_graphs, max_loras=options.max_loras,
                        max_lora_rank=options.max_lora_rank,
                        enable_lora=bool(options.lora_modules) or options.enable_lora_loading)


def load_engine(model_dir: Path, tokenizer: Tokenizer, options: EngineOptions) -> Engine:
    """Load the model in `model_dir` and make an Engine over it with the options' pool and limits.

    With a tensor-parallel group (--tensor-parallel-size N, or torchrun's), this process is its rank 0:
    the other ranks are started (or joined) first, each loads its own shard, and this one sends them the
    engine's configuration; `Engine.close()` ends the group."""
    from pagoda.model.loader import resolve_device, weight_format

    size = group_size(options.parallel)
    model_config = read_config(model_dir, options.architectures)
    context_length(options, model_config)
    ShardPlan.of(model_config, 0, size)  # a group the model cannot be split over is refused before any rank starts
    device = resolve_device(options.device)
    eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *model_config.eos_token_ids)))
    grouped = size > 1 or options.distributed_backend is not None  # a group of one: the collectives' code path
    ranks = Ranks.start(options.parallel, device.type, WorkerSpec(str(model_dir), options)) if grouped else None
    try:
        model = load_shard(model_dir, options, ranks.group if ranks else SOLO, 0 if ranks else None)
        kv_dtype = next(model.parameters()).dtype  # the KV cache's: float32 under CPU bfloat16 weights
        config = engine_config(options, model_config, kv_dtype, device)
        engine = make_engine(model, config, eos_token_ids=eos, tokenizer=tokenizer, ranks=ranks,
                             policies=options.scheduling_policies)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    load_adapters(engine, options.lora_modules)
    parallel = f", tensor parallel {size} ({ranks.group.backend})" if ranks else ""
    logger.info("model %s on %s: weights %s, KV cache %s, %d KV blocks of %d tokens, context %d, prefix caching %s%s",
                model_dir, device, weight_format(model), str(kv_dtype).removeprefix("torch."), config.num_blocks,
                config.block_size, config.max_model_len, "on" if config.enable_prefix_caching else "off", parallel)
    return engine


def load_adapters(engine: Engine, modules: tuple[tuple[str, str], ...]) -> None:
    """Load the start-up LoRA adapters (name, path) through the engine; a refused one closes the engine (and a
    tensor-parallel group's ranks) and raises AdapterError naming the adapter and the field."""
    for name, path in modules:
        try:
            engine.load_adapter(name, path)
        except BaseException as exc:
            engine.close()
            if isinstance(exc, AdapterError):
                raise AdapterError(f"LoRA adapter {name!r} ({path}) refused: {exc} [field: {exc.field}]",
                                   exc.field) from None
            raise


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """The sampling defaults a model ships in its generation_config.json (vLLM's keys); {} when it has none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if isinstance(config.get(k), (int, float))
            and not isinstance(config.get(k), bool)}


def build_engine(options: EngineOptions, *, progress: bool = True) -> tuple[Engine, Tokenizer, Path]:
    """Resolve the model, load its tokenizer and make an Engine over it; returns (engine, tokenizer, model_dir)."""
    from pagoda.model.hub import resolve_model

    layouts = (options.architectures or builtin_architectures()).gguf_layouts  # a GGUF file's, by its architecture
    model_dir = resolve_model(options.model, progress=progress, layouts=layouts)
    tokenizer = Tokenizer.from_dir(model_dir)
    return load_engine(model_dir, tokenizer, options), tokenizer, model_dir
