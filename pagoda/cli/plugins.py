"""`pagoda plugins`: the loaded plugins, their hooks, what they register, where they come from."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from pagoda.plugins.manager import ALLOW_ENV, PluginError, describe_plugins, load_plugins


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins, their hooks and where they come from",
                       description=f"Built-in plugins always load; installed ones as ${ALLOW_ENV} allows "
                                   "(unset: all, 'none': none, 'a,b': those entry points).")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        infos = describe_plugins(load_plugins())
    except PluginError as exc:
        raise SystemExit(f"pagoda plugins: {exc}") from None
    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    for info in infos:
        print(f"{info.name}  ({info.origin})")
        print(f"    hooks: {', '.join(info.hooks) or '-'}")
        for item in info.provides:
            print(f"    {item}")
    return 0
