"""The Rig page in the main window: reached by Ctrl+5, telemetry starts when it is shown (and says
"no NVIDIA driver" without one), a finished download joins the library and its folder is remembered,
a rename reaches the open chat, Open shows a found chat on the Chat page, closing stops it all."""

from __future__ import annotations

from minecart.app import telemetry
from minecart.app.conversations import Conversation
from minecart.app.main_window import MainWindow
from minecart.app.settings import Settings
from PySide6.QtGui import QKeySequence

from tests.app.fake_nvml import FakeNvml, NVMLError


def test_rig_page(qtbot, make_bridge, two_gpus, tmp_path, monkeypatch):
    monkeypatch.setattr(telemetry, "_import_pynvml",
                        lambda: FakeNvml([], init_error=NVMLError("Driver Not Loaded")))
    settings = Settings()
    win = MainWindow(settings=settings, bridge=make_bridge(), devices=two_gpus, scan_defaults=False,
                     include_demo=False)
    qtbot.addWidget(win)
    win.show()
    assert not win.cockpit.telemetry.poller.isRunning()  # nothing polls until the page is shown
    shortcut = [a for a in win.actions() if a.shortcut() == QKeySequence("Ctrl+5")]
    assert len(shortcut) == 1
    win.nav.buttons[4].click()  # the rail's fifth button
    assert win.stack.currentWidget() is win.cockpit
    qtbot.waitUntil(lambda: win.cockpit.telemetry.status.text() == "no NVIDIA driver", timeout=5000)

    # a download lands in <data dir>/models; the library lists it and scans that folder from now on
    folder = win.cockpit.download_folder()
    assert folder == tmp_path / "data" / "models"
    model = folder / "acme" / "Tiny-GGUF" / "tiny.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    win.cockpit.download.downloaded.emit(model)
    assert settings["model_folders"] == [str(folder)]
    qtbot.waitUntil(lambda: any(r.path == model for r in win.library.model.rows), timeout=5000)

    # rename the chat that is open: the chat keeps the new title when it saves again
    store = win.chat.store
    win.chat.conv = Conversation(id="open1", title="Old", messages=[{"role": "user", "content": "riser?"}])
    win.chat.save()
    win.cockpit.show_tab("conversations")
    panel = win.cockpit.conversations
    qtbot.waitUntil(lambda: panel.results.count() == 1, timeout=5000)
    panel.results.setCurrentRow(0)
    assert panel.rename_selected("Risers")
    win.chat.save()
    assert store.load("open1").title == "Risers" and win.chat.conv.title == "Risers"

    # Open shows a found conversation on the Chat page
    store.save(Conversation(id="other", title="Fans", messages=[{"role": "user", "content": "fan curve"}]))
    panel.query.setText("fan curve")
    qtbot.waitUntil(lambda: panel.results.count() == 1 and panel.selected_id() is None, timeout=5000)
    panel.results.setCurrentRow(0)
    panel.open_btn.click()
    assert win.chat.conv.id == "other" and win.stack.currentWidget() is win.chat

    win.close()
    assert not win.cockpit.telemetry.poller.isRunning()
