"""Entry point of the `minecart` script: no arguments opens the desktop app, anything else is the CLI.

Qt is imported only when the window is wanted, so the CLI works on machines without a display.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        from .__main__ import main as app_main

        return app_main([])
    from minecart.engine.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
