"""`--speculative-config`, as vLLM spells it, for `pagoda serve` and `pagoda generate`."""

from __future__ import annotations

import argparse

from pagoda.core.engine_config import SpeculativeConfig

HELP = ("n-gram (prompt-lookup) drafts for greedy requests, in the rows the CPU kernels pad anyway, as JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' '
        "(the default); '{}' or 'none' turns it off")


def speculative_config(text: str) -> SpeculativeConfig | None:
    """The option's value, or argparse's error naming what is wrong."""
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_speculative_option(parser: argparse.ArgumentParser) -> None:
    """Add `--speculative-config` (dest `speculative`) to a subcommand."""
    parser.add_argument("--speculative-config", dest="speculative", type=speculative_config,
                        default=SpeculativeConfig(), metavar="JSON", help=HELP)
