"""`pagoda router`: a reverse proxy in front of pagoda replicas (docs/distributed.md, "The router").

Every option reaches RouterSettings through `router_settings`, so a test can check each flag's way
without starting anything (tests/router/test_cli.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping

from pagoda.cli.renamed_option import add_renamed_option
from pagoda.core.routing import POLICIES
from pagoda.router.settings import RouterSettings

API_KEY_ENV = "PAGODA_API_KEY"  # as `pagoda serve`


def register(sub: argparse._SubParsersAction) -> None:
    defaults = RouterSettings  # its fields' defaults
    p = sub.add_parser("router", help="a reverse proxy in front of pagoda replicas")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    policy = p.add_argument("--router-policy", default=defaults.policy, choices=POLICIES,
                            help="how a replica is chosen: prefix keys on the prompt's cached blocks, balanced by load")
    add_renamed_option(p, "--policy", policy)
    p.add_argument("--model", default="default",
                   help="the replicas' model ('default', a GGUF file or a Hugging Face directory): the prefix policy "
                        "renders prompts with its tokenizer and chat template (no weights are loaded)")
    p.add_argument("--tool-parser", default=defaults.tool_parser,
                   help="the replicas' --tool-parser, so that a prompt with tools renders as theirs do")
    p.add_argument("--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold, metavar="N",
                   help="prefix: loads count as imbalanced when the most and least in flight differ by more than N")
    p.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold, metavar="X",
                   help="prefix: ... and the most is over X times the least; then the least loaded gets the request")
    p.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold, metavar="F",
                   help="prefix: follow a cached prefix only when it covers at least this share of the prompt's blocks")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port, help="0 = let the system pick a free port (printed)")
    p.add_argument("--api-key", default=None, help=f"the key generation and model routes require (or ${API_KEY_ENV})")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="the replicas' keys file: keys are checked here, and the prefix policy keys each tenant's "
                        "prompts as the replicas' caches do; re-read on SIGHUP")
    p.add_argument("--max-queue-per-replica", type=int, default=defaults.max_queue_per_replica, metavar="N",
                   help="requests in flight through the router per replica; when every healthy one is full: 429")
    p.add_argument("--health-interval", type=float, default=defaults.health_interval, metavar="SECONDS",
                   help="how often each replica's /health is polled")
    p.add_argument("--health-timeout", type=float, default=defaults.health_timeout, metavar="SECONDS",
                   help="a replica whose /health takes longer is routed around")
    p.add_argument("--seed", type=int, default=defaults.seed, help="power_of_two's random seed")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                   help="a bigger request body is refused with 413")
    p.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout, metavar="SECONDS",
                   help="on exit, how long requests in flight may run on before they are cut")
    p.add_argument("--log-level", default=defaults.log_level, choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def router_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterSettings:
    """What the router is told by the command line (and $PAGODA_API_KEY); for the prefix policy, --model is
    resolved to its directory as `pagoda serve` resolves it (OSError or ValueError when it cannot be)."""
    environ = os.environ if environ is None else environ
    model_dir = None
    if args.router_policy == "prefix":
        from pagoda.model.hub import resolve_model

        model_dir = str(resolve_model(args.model, progress=False))
    return RouterSettings(
        replicas=tuple(args.replica), policy=args.router_policy, host=args.host, port=args.port, model_dir=model_dir,
        tool_parser=None if args.tool_parser.lower() == "none" else args.tool_parser,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
        cache_threshold=args.cache_threshold,
        api_key=args.api_key or environ.get(API_KEY_ENV) or None, api_keys_file=args.api_keys_file,
        max_queue_per_replica=args.max_queue_per_replica,
        health_interval=args.health_interval, health_timeout=args.health_timeout, seed=args.seed,
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)


def run(args: argparse.Namespace) -> int:
    try:
        settings = router_settings(args)
    except (OSError, ValueError) as exc:  # before the server's imports: a mistyped URL is said at once
        print(f"pagoda router: {exc}", file=sys.stderr)
        return 2
    from pagoda.api.server import run_server
    from pagoda.api.tenants import reload_on_sighup
    from pagoda.plugins.manager import PluginError
    from pagoda.router.app import create_router_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request and health poll
    try:
        app = create_router_app(settings)
    except (ValueError, PluginError) as exc:
        print(f"pagoda router: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        print(f"pagoda router at {url}", flush=True)

    app.on_startup.append(lambda: reload_on_sighup(app.state.tenants))  # the process's signal: `pagoda router` only

    run_server(app, settings.host, settings.port, ready, drain=app.state.drain, log_level=settings.log_level,
               timeout_graceful_shutdown=settings.shutdown_timeout)
    return 0
