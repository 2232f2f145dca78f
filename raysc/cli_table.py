"""A command line declared as a table: ``Command`` rows of ``Arg`` (one ``add_argument`` call
each), and the options several ``raysc`` commands share, declared once here."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arg:
    """One ``add_argument`` call: declared once, added to every command that takes it."""

    flags: tuple[str, ...]
    options: dict[str, Any]

    def add(self, p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
        # copied: every parser gets its own mutable default (``--set``'s list), as a literal would
        p.add_argument(*self.flags, **{k: copy.copy(v) for k, v in self.options.items()})

    def but(self, **options: Any) -> Arg:
        """The same argument with some options changed (a command's own help text)."""
        return Arg(self.flags, {**self.options, **options})


def arg(*flags: str, **options: Any) -> Arg:
    """``Arg`` in ``add_argument``'s own words."""
    return Arg(flags, options)


@dataclass(frozen=True)
class OneOf:
    """Mutually exclusive arguments."""

    args: tuple[Arg, ...]
    required: bool = False

    def add(self, p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group(required=self.required)
        for a in self.args:
            a.add(group)


@dataclass(frozen=True)
class Command:
    """A subcommand: its arguments in order (an ``Arg``, a ``OneOf`` or a function that adds its
    own), or subcommands of its own (``dest`` names the chosen one)."""

    name: str
    help: str
    func: Callable[[argparse.Namespace], int] | None = None
    args: tuple[Arg | OneOf | Callable[[argparse.ArgumentParser], None], ...] = ()
    sub: tuple[Command, ...] = ()
    dest: str | None = None

    def add_to(self, commands: argparse._SubParsersAction) -> None:
        p = commands.add_parser(self.name, help=self.help)
        if self.sub:
            inner = p.add_subparsers(dest=self.dest, required=True)
            for c in self.sub:
                c.add_to(inner)
            return
        for a in self.args:
            if isinstance(a, (Arg, OneOf)):
                a.add(p)
            else:
                a(p)
        p.set_defaults(func=self.func)


# the options several commands share
SET = arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
RUN_DIR = arg("run_dir")
JSON = arg("--json", action="store_true")
STEP = arg("--step", type=int)
