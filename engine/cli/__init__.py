"""The `minecart` command line: one subcommand per module in this package.

Each subcommand module defines `register(subparsers)`, which adds its parser and sets `func` (a callable
taking the parsed args and returning an exit code). The `minecart` script itself lives in
app/launcher.py: with no arguments it opens the desktop app, otherwise it calls `main` here.

`main` first sets the BLAS thread count (engine/threads.py; `--threads N` overrides), before anything
imports NumPy, then parses; an unknown flag is reported with the usage of the subcommand it was given to.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules, in the order `minecart --help` lists them.
COMMANDS = [
    "inspect_cmd",
    "synth_cmd",
    "run_cmd",
    "chat_cmd",
    "serve_cmd",
    "bench_cmd",
    "plan_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    """The `minecart` parser; its parsed args carry `command_parsers`, each subcommand's own parser
    by name (main reports an unknown flag with the usage of the subcommand it was given to)."""
    parser = argparse.ArgumentParser(
        prog="minecart",
        description="Run Qwen3.5/3.6 and Gemma 3 GGUF models on GPUs without tensor cores. "
        "The `minecart` script with no subcommand opens the desktop app.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # subcommand not built yet
            raise
        mod.register(sub)
    parser.set_defaults(command_parsers=dict(sub.choices))
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import MinecartError
    from ..threads import configure_threads, threads_from_argv

    argv = sys.argv[1:] if argv is None else list(argv)
    configure_threads(threads_from_argv(argv))  # before any subcommand imports NumPy
    try:
        parser = build_parser()  # imports every subcommand: Ctrl+C may land here too
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # argparse reports flags it does not know with the top-level usage; show the usage of
            # the subcommand they were given to instead
            (args.command_parsers.get(args.command or "") or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
        if not args.command:
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except MinecartError as exc:
        print(f"minecart: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nminecart: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug, but the user gets one line, not a traceback
        if os.environ.get("MINECART_DEBUG"):
            raise
        print(f"minecart: internal error: {type(exc).__name__}: {exc}\nThis is a bug in minecart; "
              "please report it with the command you ran (MINECART_DEBUG=1 shows the traceback).",
              file=sys.stderr)
        return 70  # EX_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
