"""The plan on screen is the plan that runs, with a real window and a real mouse: the app runs under Xvfb
(X server in memory) on Qt's xcb platform (tests/app/xvfb_app.py), xdotool presses the mouse on the LM
head block of the first card's lane, drags it onto the second card's lane, releases, and clicks Load;
the engine's loader must receive that plan. Skips, saying why, where Xvfb, xdotool or Qt's xcb platform
is missing (CI installs them: .ci/run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass  # being written
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None and proc.stdout else ""
    raise AssertionError(f"{path.name} never came (app exit code {proc.poll()}): {out[-2000:]}")


@pytest.fixture
def xvfb_display():
    """An Xvfb server on a free display number; its DISPLAY value."""
    for tool in ("Xvfb", "xdotool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install xvfb xdotool)")
    r, w = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", "1280x900x24", "-nolisten", "tcp"],
                              pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as fh:
        number = fh.readline().strip()
    if not number:
        server.kill()
        pytest.skip("Xvfb did not start")
    yield f":{number}"
    server.terminate()
    server.wait(10)


def _xdotool(display: str, *args: str) -> None:
    subprocess.run(["xdotool", *args], check=True, env=dict(os.environ, DISPLAY=display), timeout=20)


def test_real_mouse_drag_then_load_runs_the_dragged_plan(xvfb_display, tiny_model, tmp_path):
    env = dict(os.environ, DISPLAY=xvfb_display, QT_QPA_PLATFORM="xcb",
               MINECART_CONFIG_DIR=str(tmp_path / "config"), MINECART_DATA_DIR=str(tmp_path / "data"))
    env.pop("MINECART_SIMULATE_DEVICES", None)
    probe = subprocess.run([sys.executable, "-c", "from PySide6.QtWidgets import QApplication; QApplication([])"],
                           env=env, capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("Qt's xcb platform cannot start here (missing X libraries such as libxcb-cursor0): "
                    + probe.stderr.decode(errors="replace").strip().splitlines()[-1])
    app = subprocess.Popen([sys.executable, "-m", "tests.app.xvfb_app", str(tiny_model), str(tmp_path)],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        geo = _wait_file(tmp_path / "geometry.json", app, 60)
        before = geo["before"]
        assert before[-1] == "cuda:0" and "cuda:1" not in before  # the automatic plan: one card
        (hx, hy), (bx, by), (lx, ly) = geo["head"], geo["lane_b"], geo["load"]
        # a real press, a move in steps (Qt starts a drag past its drag distance), a real release
        _xdotool(xvfb_display, "mousemove", "--sync", str(hx), str(hy))
        _xdotool(xvfb_display, "mousedown", "1")
        for k in range(1, 13):
            _xdotool(xvfb_display, "mousemove", "--sync", str(hx + (bx - hx) * k // 12),
                     str(hy + (by - hy) * k // 12))
            time.sleep(0.05)
        time.sleep(0.2)
        _xdotool(xvfb_display, "mouseup", "1")
        time.sleep(0.5)
        _xdotool(xvfb_display, "mousemove", "--sync", str(lx), str(ly), "click", "1")
        result = _wait_file(tmp_path / "result.json", app, 60)
    finally:
        if app.poll() is None:
            app.kill()
        app.wait(10)
    received = result["received"]
    assert received is not None, "Load reached the engine without a plan"
    # the LM head was dragged to the second card; everything else stayed where the plan had it
    assert received[-1] == "cuda:1"
    assert received[:-1] == before[:-1]
    assert result["shown"] == received  # the map shows what the engine placed
