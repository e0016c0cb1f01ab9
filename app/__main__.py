"""`python -m minecart.app`: the desktop window (placeholder until the app lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("The desktop app is not built yet; use `minecart --help` for the CLI.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
