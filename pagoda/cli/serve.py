"""`pagoda serve`: the HTTP server (OpenAI and Anthropic protocols, plus any plugin's).

Every option reaches what it configures through two functions, `engine_options` (the model and the engine:
EngineOptions, then EngineConfig in pagoda.model.factory) and `serve_settings` (the HTTP server: ServeSettings),
so that a test can check each flag's way without loading a model (tests/cli/test_serve.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pagoda.api.settings import ServeSettings
from pagoda.cli.data_parallel import add_data_parallel_options
from pagoda.cli.parallel_option import add_parallel_options, parallel_fields
from pagoda.cli.plugins import add_disable_option
from pagoda.cli.speculative_option import add_speculative_option
from pagoda.core.adapters import AdapterError, check_adapter_name
from pagoda.core.engine_config import EngineConfig
from pagoda.core.scheduling import SchedulingPolicy
from pagoda.model.architectures import Architectures
from pagoda.model.factory import EngineOptions, generation_defaults
from pagoda.plugins.request_fields import RequestLimits

API_KEY_ENV = "PAGODA_API_KEY"
# After a tensor-parallel rank is lost, /health says why (503) for this long, then the server exits 1
# (docs/distributed.md): long enough for a load balancer's probe to read the reason.
FAILED_GROUP_LINGER_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    # no abbreviations: a flag of another server's (vLLM's --enable-lora) must never pass for a prefix of pagoda's
    p = sub.add_parser("serve", help="the HTTP server", allow_abbrev=False)
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = let the system pick a free port (printed)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "w8a8", "int8", "int4"),
                   help="weight format of the linear layers on the CPU (docs/models.md): auto (the default) runs a "
                        "GGUF's own blocks (gguf) and a float checkpoint as it is (none); w8a8 rounds every weight to "
                        "Q8_0 blocks; int8/int4 are weight-only")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV cache block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from free memory)")
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running, help="requests in one step")
    p.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_batched_tokens,
                   help="new tokens in one step")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV of equal prompt prefixes between requests")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="each answer's bits independent of the batch it ran in (default: on for the CPU, which "
                        "proves its kernels at start-up; off for CUDA); --no-batch-invariant: the fastest kernels")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode-only steps of up to 64 sequences replay CUDA graphs captured at start-up (CUDA only; "
                        "elsewhere it says why not and runs as without)")
    p.add_argument("--no-cpu-graphs", dest="cpu_graphs", action="store_false",
                   help="run every CPU step eagerly (default: decode-only steps replay a recorded step in one native "
                        "call where every kernel of the step is pagoda's own, as with the default GGUF format)")
    p.add_argument("--api-key", default=None, help=f"the key generation and model routes require (or ${API_KEY_ENV})")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="tenants: their keys' SHA-256, weights, priorities and limits (.json or .toml; "
                        "docs/reliability.md); re-read on SIGHUP. With --api-key, that key is one more tenant, "
                        "'default'")
    p.add_argument("--disconnect-policy", default="abort", help="what to do with a request whose client left")
    p.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy, metavar="NAME",
                   help="who is admitted, gets the step's tokens and is preempted: a registered scheduling policy "
                        "(built in: fcfs, priority, fair; default fcfs)")
    p.add_argument("--tool-parser", default=ServeSettings.tool_parser,
                   help="the model's tool-call syntax: a registered tool parser (built in: hermes, llama3_json);"
                        " 'none' refuses requests with tools")
    p.add_argument("--send-stall-timeout", type=float, default=2.0,
                   help="seconds a stream may make no write progress before its client counts as gone")
    p.add_argument("--send-buffer-size", type=int, default=None, metavar="BYTES",
                   help="each connection's socket send buffer (default: the kernel's autotuning); bounds how much "
                        "unread output a client that stopped reading holds before the stall deadline counts")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="requests the queue may hold; beyond, new ones are refused at once with 429 (default: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=ServeSettings.max_body_bytes,
                   help="a bigger request body is refused with 413")
    p.add_argument("--max-header-bytes", type=int, default=ServeSettings.max_header_bytes,
                   help="request headers beyond this many bytes are refused with 431")
    p.add_argument("--request-read-timeout", type=float, default=ServeSettings.request_read_timeout,
                   metavar="SECONDS", help="a request that has not arrived whole (headers and body) this long after "
                                           "its first byte is answered 408 and its connection closed")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once; a request on one more is answered 503 (default: no cap)")
    p.add_argument("--generation-config", default="auto", choices=("auto", "none"),
                   help="auto: a request that leaves temperature/top_p/top_k null gets the model's defaults from its "
                        "generation_config.json; none: pagoda's own defaults")
    p.add_argument("--shutdown-timeout", type=float, default=ServeSettings.shutdown_timeout, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may run on before they are aborted")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may ask for: the first is listed, the rest are aliases "
                        "(default: the model's); any other name is refused with 404")
    p.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="origins a browser page may call the API from (CORS); none by default")
    lora = p.add_argument_group("LoRA adapters (vLLM's flags; docs/reliability.md)")
    lora.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                      help="PEFT LoRA adapter directories loaded at start-up, each served as the model NAME (listed "
                           "by /v1/models with the served model as its parent); also vLLM's JSON form "
                           "'{\"name\": NAME, \"path\": PATH, \"base_model_name\": PARENT}' (PARENT: the parent "
                           "its card names)")
    lora.add_argument("--max-loras", type=int, default=EngineConfig.max_loras, metavar="N",
                      help="distinct adapters with requests in one step (a request for another waits)")
    lora.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank, metavar="R",
                      help="an adapter of a higher rank is refused when it is loaded")
    lora.add_argument("--enable-lora-loading", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies), which load "
                           "and unload adapters while serving (with keys, only for a key that may manage adapters)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="accepted as vLLM spells it, and changes nothing: LoRA is on whenever --lora-modules or "
                           "--enable-lora-loading is given")
    limits, g = RequestLimits(), p.add_argument_group("request limits (over one: 400 naming the field)")
    g.add_argument("--max-stop-strings", type=int, default=limits.max_stop, metavar="N",
                   help="stop strings one request may send")
    g.add_argument("--max-stop-length", type=int, default=limits.max_stop_length, metavar="CHARS",
                   help="characters in one stop string")
    g.add_argument("--max-logprobs", type=int, default=limits.max_logprobs, metavar="N",
                   help="top alternatives per token one request may ask for (at most 20)")
    g.add_argument("--max-output-tokens", type=int, default=limits.max_tokens, metavar="N",
                   help="output tokens one request may ask for (default: whatever fits the context)")
    p.add_argument("--log-level", default=ServeSettings.log_level, choices=("debug", "info", "warning", "error"))
    add_speculative_option(p)
    add_parallel_options(p)
    add_data_parallel_options(p)
    add_disable_option(p)
    p.set_defaults(func=run)


def engine_options(args: argparse.Namespace, architectures: Architectures | None = None,
                   scheduling_policies: Mapping[str, type[SchedulingPolicy]] | None = None) -> EngineOptions:
    """The model and engine options the command line gives (pagoda.model.factory builds the engine from them);
    `architectures` and `scheduling_policies`: the registries the loaded plugins make (None: the built-in ones)."""
    return EngineOptions(architectures=architectures, model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                         block_size=args.block_size, num_blocks=args.num_blocks, max_running=args.max_running,
                         max_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
                         enable_prefix_caching=args.prefix_caching, max_waiting=args.max_waiting,
                         speculative=args.speculative, scheduling_policy=args.scheduling_policy,
                         scheduling_policies=scheduling_policies, batch_invariant=args.batch_invariant,
                         cuda_graphs=args.cuda_graphs, cpu_graphs=args.cpu_graphs,
                         lora_modules=lora_modules(args.lora_modules), max_loras=args.max_loras,
                         max_lora_rank=args.max_lora_rank, enable_lora_loading=args.enable_lora_loading,
                         **parallel_fields(args))


def lora_modules(values: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--lora-modules' (name, path) pairs: each NAME=PATH, or vLLM's JSON '{"name": NAME, "path": PATH}'."""
    return tuple((name, path) for name, path, _ in _lora_specs(values))


def lora_parents(values: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(name, parent) of the --lora-modules whose JSON form gives vLLM's `base_model_name`: the parent their cards
    name (any other's is the served name)."""
    return tuple((name, parent) for name, _, parent in _lora_specs(values) if parent is not None)


def _lora_specs(values: list[str] | tuple[str, ...]) -> list[tuple[str, str, str | None]]:
    """Each --lora-modules value as (name, path, base_model_name or None); ValueError naming a malformed one."""
    modules = []
    for value in values:
        parent = None
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not JSON ({exc.msg})") from None
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs \"name\" and \"path\" strings")
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(f"--lora-modules {value!r}: unknown field {unknown[0]!r} (known: name, path, "
                                 f"base_model_name)")
            parent = spec.get("base_model_name")
            if parent is not None and (not isinstance(parent, str) or not parent):
                raise ValueError(f"--lora-modules {value!r}: base_model_name must be a non-empty string")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH")
        if not name or not path:
            raise ValueError(f"--lora-modules {value!r}: both the name and the path must be given")
        modules.append((name, path, parent))
    return modules


def check_lora_modules(modules: tuple[tuple[str, str], ...], served_names: list[str]) -> None:
    """What can be refused before the model loads: a name a request could not reach (the served model's, white
    space around it), a directory that is not there (every other check of an adapter needs the model:
    Engine.load_adapter makes it)."""
    for name, path in modules:
        try:
            check_adapter_name(name, served_names)
            if not Path(path).expanduser().is_dir():
                raise AdapterError(f"lora_path {path!r} is not a directory", "lora_path")
        except AdapterError as exc:
            raise ValueError(f"LoRA adapter {name!r} ({path}) refused: {exc} [field: {exc.field}]") from None


def serve_settings(args: argparse.Namespace, model_dir: Path, environ: Mapping[str, str] | None = None) -> ServeSettings:
    """What the HTTP server is told, for the model in `model_dir` (its name and generation defaults)."""
    environ = os.environ if environ is None else environ
    names = args.served_model_name or [served_name(args.model)]
    limits = RequestLimits(max_stop=args.max_stop_strings, max_stop_length=args.max_stop_length,
                           max_logprobs=args.max_logprobs, max_tokens=args.max_output_tokens)
    return ServeSettings(
        host=args.host, port=args.port, log_level=args.log_level, disabled_plugins=tuple(args.disable_plugin),
        served_model_name=names[0], served_model_aliases=tuple(names[1:]),
        api_key=args.api_key or environ.get(API_KEY_ENV) or None, api_keys_file=args.api_keys_file,
        disconnect_policy=args.disconnect_policy,
        tool_parser=None if args.tool_parser.lower() == "none" else args.tool_parser,
        send_stall_timeout=args.send_stall_timeout, send_buffer_size=args.send_buffer_size,
        max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
        request_read_timeout=args.request_read_timeout, max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout, allowed_origins=tuple(args.allowed_origins), request_limits=limits,
        enable_lora_loading=args.enable_lora_loading, lora_parents=lora_parents(args.lora_modules),
        generation_defaults=generation_defaults(model_dir) if args.generation_config == "auto" else {})


def served_name(model: str) -> str:
    """The name a model is served as by default: "default", a GGUF file's stem, else the directory's name."""
    if model == "default":
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:  # this process supervises N replicas and the router (no model here)
        from pagoda.cli.data_parallel import run_data_parallel
        return run_data_parallel(args, getattr(args, "command_line", None),
                                 api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    from pagoda.model.ranks import serve_as_worker
    from pagoda.model.factory import build_engine
    from pagoda.model.hub import resolve_model
    from pagoda.api.keys_file import read_keys_file
    from pagoda.model.families import register_families
    from pagoda.plugins.manager import PluginError, collect_architectures, collect_scheduling_policies, load_plugins

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.api_keys_file is not None:  # refused before the model loads: a typo costs no start-up
            read_keys_file(args.api_keys_file)
        plugins = register_families(load_plugins(disabled=args.disable_plugin))
        options = engine_options(args, Architectures(collect_architectures(plugins)), collect_scheduling_policies(plugins))
        # an adapter's name or a missing directory is refused before the model loads, too
        check_lora_modules(options.lora_modules, args.served_model_name or [served_name(args.model)])
        model_dir = resolve_model(options.model, layouts=options.architectures.gguf_layouts)
        status = serve_as_worker(model_dir, options)  # under torchrun, a rank other than 0
        if status is not None:
            return status
        engine, tokenizer, model_dir = build_engine(options)
    except (ValueError, FileNotFoundError, PluginError) as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, engine, tokenizer, model_dir, plugins)
    finally:
        engine.close()  # a tensor-parallel group's ranks stop (already done after a drain; idempotent)


def _serve(args: argparse.Namespace, engine, tokenizer, model_dir: Path, plugins) -> int:
    from pagoda.api.app import create_app
    from pagoda.api.drain import drain
    from pagoda.api.server import run_server
    from pagoda.api.tenants import reload_on_sighup
    from pagoda.core.async_engine import AsyncEngine
    from pagoda.plugins.manager import PluginError

    try:
        settings = serve_settings(args, model_dir)
        async_engine = AsyncEngine(engine, on_crash=_exit_after_lost_rank)
        app = create_app(async_engine, tokenizer, plugins, settings)
    except (ValueError, PluginError) as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2
    # stderr, with the log: stdout's first line stays the URL (the contract), which scripts read
    print(f"pagoda serve: speculative decoding {engine.speculation.reason}", file=sys.stderr, flush=True)
    print(f"pagoda serve: batch invariance {engine.runner.invariance.summary()}", file=sys.stderr, flush=True)
    if args.cuda_graphs or getattr(getattr(engine.runner, "device", None), "type", None) == "cpu":
        kind = "CUDA graphs" if args.cuda_graphs else "CPU step graphs"
        print(f"pagoda serve: {kind} {getattr(engine.runner, 'graphs_summary', 'off: not this runner')}",
              file=sys.stderr, flush=True)

    def ready(url: str) -> None:
        print(f"pagoda serving {settings.served_model_name!r} at {url}", flush=True)

    services = app.state.services
    app.on_startup.append(lambda: reload_on_sighup(services.tenants))  # the process's signal: `pagoda serve` only

    async def drain_server() -> None:
        await drain(services.drain, async_engine, settings.shutdown_timeout)

    run_server(app, settings.host, settings.port, ready, send_buffer=settings.send_buffer_size, drain=drain_server,
               log_level=settings.log_level)
    if async_engine.failure is not None:
        print(f"pagoda serve: the engine stopped: {async_engine.failure}", file=sys.stderr)
        return 1
    return 0


def _exit_after_lost_rank(failure: BaseException) -> None:
    """A tensor-parallel group that lost a rank cannot serve again: say so on /health a while, then exit."""
    import signal
    import threading

    from pagoda.core.batch import RunnerLost

    if isinstance(failure, RunnerLost):
        logging.getLogger("pagoda.api").error("%s; /health says so for %g s, then the server exits", failure,
                                              FAILED_GROUP_LINGER_S)
        threading.Timer(FAILED_GROUP_LINGER_S, signal.raise_signal, (signal.SIGTERM,)).start()
