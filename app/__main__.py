"""`python -m minecart.app` (and `minecart` with no arguments): open the desktop window.

Options: `--model PATH` selects (and loads) a GGUF instead of the default (the last model used, else the
demo model); `--screenshot PATH [--view chat|models|layers|graphs]` renders the window offscreen with the
model loaded, saves a PNG and exits (`--prompt TEXT` first sends one chat message and waits for the
reply, so the chat view has something to show; `--during-reply` takes the pictures while it streams;
`--conversation FILE` shows a saved conversation instead).

Screenshot mode runs in a throwaway profile: settings and conversations go to a temporary folder that
is deleted on exit, so the user's settings (max tokens, thinking) and conversation list are untouched.
The engine itself lives in minecart.engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The NumPy engine shares two cores with the GUI thread: OpenBLAS threads fighting the GUI for them made
# small matmuls 4-5x slower in measurements, so the app runs BLAS single-threaded unless told otherwise.
# (Set before numpy is first imported; the user's own setting wins.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minecart.app", description="The minecart desktop app.")
    p.add_argument("--model", help="GGUF file to select and load (default: the last one used, else the demo model)")
    p.add_argument("--no-load", action="store_true", help="select the model but do not load it")
    p.add_argument("--no-scan", action="store_true",
                   help="do not scan model folders or the demo model at start (only --model is listed)")
    p.add_argument("--screenshot", metavar="PATH", help="render the window offscreen to this PNG and exit")
    p.add_argument("--view", default="chat",
                   help="page to show: chat, models, layers or graphs; with --screenshot a comma-separated "
                        "list captures several pages (PATH must then contain {view})")
    p.add_argument("--prompt", help="with --screenshot: send this chat message first and wait for the reply")
    p.add_argument("--thinking", action="store_true", help="with --prompt: turn thinking on for that message")
    p.add_argument("--max-tokens", type=int, help="with --prompt: cap the reply at this many tokens")
    p.add_argument("--during-reply", action="store_true",
                   help="with --prompt: take the pictures while the reply streams (after 400 characters)")
    p.add_argument("--conversation", metavar="FILE",
                   help="with --screenshot: show this saved conversation (JSON, as the app saves them)")
    p.add_argument("--size", default="1440x900", help="window size WxH (default 1440x900)")
    p.add_argument("--timeout", type=float, default=600.0, help="with --screenshot: give up waiting after this many seconds")
    return p


def _wait(app, predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        app.processEvents()
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def throwaway_profile():
    """Settings and conversations in a temporary folder for as long as the block runs."""
    keys = ("MINECART_CONFIG_DIR", "MINECART_DATA_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    folder = tempfile.mkdtemp(prefix="minecart-screenshot-")
    os.environ["MINECART_CONFIG_DIR"] = os.path.join(folder, "config")
    os.environ["MINECART_DATA_DIR"] = os.path.join(folder, "data")
    try:
        yield Path(folder)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.screenshot:
        return _run(args)
    if not os.environ.get("QT_QPA_PLATFORM"):
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    with throwaway_profile():
        return _run(args)


def _run(args) -> int:
    from PySide6.QtWidgets import QApplication

    from . import theme
    from .main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("minecart")
    app.setOrganizationName("minecart")
    theme.apply(app)
    win = MainWindow(scan_defaults=False if args.no_scan else None, include_demo=not args.no_scan)
    try:
        w, h = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        w, h = 1440, 900
    win.resize(w, h)
    views = [v.strip() for v in args.view.split(",") if v.strip()]
    bad = [v for v in views if v not in ("chat", "models", "layers", "graphs")]
    if bad or not views:
        print(f"minecart: unknown view {bad or args.view!r}; use chat, models, layers or graphs", file=sys.stderr)
        return 2
    if args.screenshot and len(views) > 1 and "{view}" not in args.screenshot:
        print("minecart: with several views, --screenshot PATH must contain {view}", file=sys.stderr)
        return 2
    win.show_page(views[0])
    win.show()
    load_errors: list[str] = []
    win.bridge.load_failed.connect(load_errors.append)
    win.start(args.model, autoload=not args.no_load)
    if not args.screenshot:
        return app.exec()

    # Screenshot mode: wait for the load (or its failure), optionally one chat turn, then grab.
    ok = _wait(app, lambda: bool(load_errors) or (not win.loading and win.selected is not None),
               args.timeout)
    if load_errors:
        print(f"minecart: could not load the model: {load_errors[-1]}", file=sys.stderr)
    elif not ok:
        print("minecart: timed out waiting for the model to load", file=sys.stderr)
    if not load_errors:  # a failed load makes no layer plan: do not wait 30 s for one
        _wait(app, lambda: win.layer_model.plan is not None, 30)
    _wait(app, lambda: win.library.scan_thread is None or win.library.scan_thread.isFinished(), 60)
    if args.conversation:
        if not _show_conversation(win, Path(args.conversation)):
            return 2
    if args.prompt and win.chat.model_loaded:
        win.chat.think_btn.setChecked(args.thinking)
        if args.max_tokens:
            win.chat.settings_panel.max_tokens.setValue(args.max_tokens)
        win.chat.input.setPlainText(args.prompt)
        win.chat.send()
        if args.during_reply:
            _wait(app, lambda: not win.bridge.generating or (
                win.chat.current is not None and len(win.chat.current.message.get("content") or "") >= 400),
                args.timeout)
        else:
            _wait(app, lambda: not win.bridge.generating, args.timeout)
    all_saved = True
    for view in views:
        win.show_page(view)
        end = time.monotonic() + 1.2  # let the graphs timer and layouts settle
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)
        pix = win.grab()
        path = args.screenshot.replace("{view}", view)
        saved = pix.save(path, "PNG")
        all_saved = all_saved and saved
        print(f"{'saved' if saved else 'could not save'} {path} ({pix.width()}x{pix.height()})")
    win.chat.stop()
    win.close()
    app.processEvents()
    return 0 if all_saved else 1


def _show_conversation(win, path: Path) -> bool:
    """Open a saved conversation file in the chat (copied into the throwaway profile's store)."""
    from .conversations import Conversation

    try:
        conv = Conversation.from_dict(json.loads(path.read_text("utf-8")))
    except (OSError, ValueError) as exc:
        print(f"minecart: cannot show the conversation {path}: {exc}", file=sys.stderr)
        return False
    win.chat.store.save(conv)
    win.chat.refresh_conversations()
    win.chat.open_conversation(conv.id)
    return True


if __name__ == "__main__":
    sys.exit(main())
