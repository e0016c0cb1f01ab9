"""installers/minecart.spec builds: PyInstaller makes the one-folder app (about 45 s and 0.7 GB here), and
the bundled program starts and renders the layer map of a small synthetic model to a PNG offscreen
(`minecart --screenshot ... --view layers`: the app's options reach the window, app/launcher.py).
Skips, saying why, where PyInstaller is not installed (the `test` extra installs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pyinstaller_one_folder_build_starts_and_renders_a_screenshot(tmp_path):
    if importlib.util.find_spec("PyInstaller") is None:
        pytest.skip("PyInstaller is not installed (pip install pyinstaller, or the `test` extra)")
    from minecart.engine.synth import SHAPES, write_synthetic
    from PIL import Image

    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", MINECART_CONFIG_DIR=str(tmp_path / "config"),
               MINECART_DATA_DIR=str(tmp_path / "data"))
    build = subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                            "--distpath", str(tmp_path / "dist"), "--workpath", str(tmp_path / "build"),
                            str(REPO / "installers" / "minecart.spec")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert build.returncode == 0, build.stderr[-3000:]
    exe = tmp_path / "dist" / "minecart" / ("minecart.exe" if os.name == "nt" else "minecart")
    assert exe.is_file()

    model = tmp_path / "tiny-dense.gguf"
    write_synthetic(model, SHAPES["tiny-dense"], "q8_0", seed=3)
    shot = tmp_path / "layers.png"
    run = subprocess.run([str(exe), "--screenshot", str(shot), "--view", "layers", "--no-load", "--no-scan",
                          "--model", str(model), "--size", "1280x800", "--timeout", "60"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"saved {shot}" in run.stdout
    with Image.open(shot) as img:
        assert img.size == (1280, 800)
        # a rendered window, not a blank frame: the style sheet's many colours and anti-aliased text
        assert len(img.convert("RGB").getcolors(1 << 20)) > 200
