"""The ``dapo-megatron`` command line.

One executable with a sub-command per task (``config`` now; ``train``, ``convert``,
``plan`` and ``bench`` arrive with their components). Sub-commands import their
components lazily, so ``dapo-megatron --help`` and ``dapo-megatron config`` work on any
machine, with or without megatron's GPU extras. Exit status: 0 on success, 2 for a
config or usage error (with a message that names the key, the value and the rule), 1 for
a failure while running.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from dapo_megatron import __version__
from dapo_megatron.config import ConfigError, load_config

EXIT_USAGE = 2


def _cmd_config(args: argparse.Namespace) -> int:
    config = load_config(args.file, args.overrides)
    sys.stdout.write(config.to_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dapo-megatron`` and its sub-commands."""
    parser = argparse.ArgumentParser(
        prog="dapo-megatron",
        description="DAPO reinforcement-learning training on megatron-core (CPU or GPU).",
    )
    parser.add_argument("--version", action="version", version=f"dapo-megatron {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = commands.add_parser(
        "config",
        help="validate a run config and print it fully resolved, as YAML",
        description="Load FILE.yaml strictly, apply section.key=value overrides, fill the "
        "model shape from model.hf_config, check the layout, and print the resolved config.",
    )
    config.add_argument("file", metavar="FILE.yaml", help="run config")
    config.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. parallel.tp_size=8")
    config.set_defaults(func=_cmd_config)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"dapo-megatron {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
