"""The `minecart` script: no arguments or the app's own options open the window (a bundled build has
only this program, so `minecart --screenshot out.png` must reach the app); a subcommand or --help is
the CLI."""

from __future__ import annotations

import minecart.app.__main__ as app_main
import minecart.engine.cli as cli
from minecart.app import launcher


def test_app_options_open_the_window_and_subcommands_reach_the_cli(monkeypatch):
    calls = []
    monkeypatch.setattr(app_main, "main", lambda argv: calls.append(("app", argv)) or 0)
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(("cli", argv)) or 0)
    for argv in ([], ["--screenshot", "x.png", "--view", "layers"], ["--no-load"], ["plan", "--help"],
                 ["--help"]):
        assert launcher.main(argv) == 0
    assert calls == [("app", []), ("app", ["--screenshot", "x.png", "--view", "layers"]), ("app", ["--no-load"]),
                     ("cli", ["plan", "--help"]), ("cli", ["--help"])]
