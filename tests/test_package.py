"""The package installs under the minecart.* names and the CLI parser builds."""

import subprocess
import sys


def test_import_names():
    import minecart.app
    import minecart.engine
    import minecart.kernels

    assert minecart.engine.load_model


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "minecart.engine.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "minecart" in out
