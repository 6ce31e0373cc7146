"""`pagoda plugins`: the loaded plugins, their hooks, what they register, where they come from."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from pagoda.model.families import register_families
from pagoda.plugins.manager import ALLOW_ENV, DISABLE_ENV, PluginError, describe_plugins, load_plugins


def add_disable_option(parser: argparse.ArgumentParser) -> None:
    """`--disable-plugin NAME...` (dest `disable_plugin`), for every command that loads the plugins."""
    parser.add_argument("--disable-plugin", nargs="+", default=[], metavar="NAME",
                        help=f"leave these plugins out, built-in or installed (also ${DISABLE_ENV}, comma-separated)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins, their hooks and where they come from",
                       description=f"Built-in plugins load unless disabled; installed ones as ${ALLOW_ENV} allows "
                                   f"(unset: all, 'none': none, 'a,b': those entry points); ${DISABLE_ENV} "
                                   "or --disable-plugin leaves any of them out.")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    add_disable_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        infos = describe_plugins(register_families(load_plugins(disabled=args.disable_plugin)))
    except PluginError as exc:
        raise SystemExit(f"pagoda plugins: {exc}") from None
    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    for info in infos:
        if info.disabled:
            print(f"{info.name}  ({info.origin}, disabled)")
            continue
        print(f"{info.name}  ({info.origin})")
        print(f"    hooks: {', '.join(info.hooks) or '-'}")
        for item in info.provides:
            print(f"    {item}")
    return 0
