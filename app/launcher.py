"""Entry point of the `minecart` script: no arguments opens the desktop app, a subcommand is the CLI.
Options before any subcommand are the app's (`minecart --screenshot out.png --view layers`, see
app/__main__.py; the CLI's top level has none but --help), so a bundled build
(installers/minecart.spec), which has only this one program, can still be told how to open.

Qt is imported only when the window is wanted, so the CLI works on machines without a display.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--") and argv[0] != "--help":
        # absolute: a bundled build runs this file as a script, outside its package
        from minecart.app.__main__ import main as app_main

        return app_main(argv)
    from minecart.engine.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
