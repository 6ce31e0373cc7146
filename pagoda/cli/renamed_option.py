"""An option's old name, kept for one release after a rename: it still works, and says on stderr what to use."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class RenamedOption(argparse.Action):
    """Stores into the new option's destination, after one line on stderr naming the new option."""

    def __init__(self, option_strings: Sequence[str], dest: str, new_name: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new_name = new_name

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated and goes in the next release; use {self.new_name}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed_option(parser: argparse.ArgumentParser, old_name: str, new: argparse.Action) -> None:
    """`old_name` as a hidden alias of the option `new` (what `add_argument` returned): same destination, type and
    choices, no default of its own."""
    parser.add_argument(old_name, action=RenamedOption, new_name=new.option_strings[0], dest=new.dest, type=new.type,
                        choices=new.choices, metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
