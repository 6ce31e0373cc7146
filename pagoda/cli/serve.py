"""`pagoda serve`: the HTTP server (OpenAI and Anthropic protocols, plus any plugin's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagoda.core.engine_config import EngineConfig

API_KEY_ENV = "PAGODA_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the HTTP server")
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = let the system pick a free port (printed)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV cache block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from free memory)")
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running, help="requests in one step")
    p.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_batched_tokens,
                   help="new tokens in one step")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    p.add_argument("--api-key", default=None, help=f"the key generation and model routes require (or ${API_KEY_ENV})")
    p.add_argument("--disconnect-policy", default="abort", help="what to do with a request whose client left")
    p.add_argument("--send-stall-timeout", type=float, default=2.0,
                   help="seconds a stream may make no write progress before its client counts as gone")
    p.add_argument("--send-buffer-size", type=int, default=None, metavar="BYTES",
                   help="each connection's socket send buffer (default: the kernel's autotuning); bounds how much "
                        "unread output a client that stopped reading holds before the stall deadline counts")
    p.add_argument("--served-model-name", default=None, help="the model name the API reports (default: the model's)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagoda.api.app import create_app
    from pagoda.model.factory import EngineOptions, build_engine
    from pagoda.api.server import run_server
    from pagoda.api.settings import ServeSettings
    from pagoda.core.async_engine import AsyncEngine
    from pagoda.plugins.manager import PluginError, load_plugins

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = EngineOptions(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                                num_blocks=args.num_blocks, max_running=args.max_running,
                                max_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len)
        plugins = load_plugins()
        engine, tokenizer, model_dir = build_engine(options)
        name = args.served_model_name or (args.model if args.model == "default" else model_dir.name)
        settings = ServeSettings(served_model_name=name, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                                 disconnect_policy=args.disconnect_policy, send_stall_timeout=args.send_stall_timeout,
                                 send_buffer_size=args.send_buffer_size)
        app = create_app(AsyncEngine(engine), tokenizer, plugins, settings)
    except (ValueError, FileNotFoundError, PluginError) as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        print(f"pagoda serving {name!r} at {url}", flush=True)

    run_server(app, args.host, args.port, ready, send_buffer=settings.send_buffer_size, log_level=args.log_level)
    return 0
