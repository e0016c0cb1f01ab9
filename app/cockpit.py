"""The Rig page: the mining-rig cockpit's four tabs (GPU telemetry, the API server switch, model downloads,
conversation search/rename/export) and their wiring to the window's engine bridge, devices, settings,
library and chat.

The main window only adds this page; everything each tab needs from the window is read here through
the window's public attributes. NVML polling starts the first time the page is shown, so a window that
never opens it runs no telemetry thread.

Not here: any panel's own logic (app/telemetry_panel.py, app/server_panel.py, app/download_panel.py,
app/conversations_panel.py).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QLabel, QTabWidget, QVBoxLayout, QWidget

from .conversations_panel import ConversationsPanel
from .download import download_folder
from .download_panel import DownloadPanel
from .server_panel import ServerPanel
from .settings import data_dir
from .telemetry_panel import TelemetryPanel

TABS = ("telemetry", "server", "download", "conversations")


class Cockpit(QWidget):
    def __init__(self, window, nvml=None, parent=None):
        super().__init__(parent)
        self.window_ = window
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 12)
        lay.setSpacing(8)
        title = QLabel("Rig")
        title.setObjectName("PageTitle")
        lay.addWidget(title)
        self.tabs = QTabWidget()
        lay.addWidget(self.tabs, 1)
        self.telemetry = TelemetryPanel(lambda: window.bridge.metrics, nvml=nvml)
        self.server = ServerPanel(lambda: window.bridge.runtime)
        self.download = DownloadPanel(window.layer_model.planning_devices, self.download_folder,
                                      lambda: int(window.settings.get("context_length", 4096)))
        self.conversations = ConversationsPanel(window.chat.store)
        for widget, name in ((self.telemetry, "GPUs"), (self.server, "API server"),
                             (self.download, "Download"), (self.conversations, "Conversations")):
            self.tabs.addTab(widget, name)
        self.download.downloaded.connect(self._downloaded)
        self.conversations.renamed.connect(self._renamed)
        self.conversations.open_requested.connect(self._open_conversation)
        self.tabs.currentChanged.connect(self._tab_shown)
        self._searched = False

    def show_tab(self, name: str) -> None:
        self.tabs.setCurrentIndex(TABS.index(name))

    def showEvent(self, e):
        super().showEvent(e)
        self.telemetry.start()
        self._tab_shown(self.tabs.currentIndex())

    def _tab_shown(self, index: int) -> None:
        if TABS[index] == "conversations" and not self._searched:
            self._searched = True
            self.conversations.search()

    def download_folder(self) -> Path:
        return download_folder(self.window_.settings.get("model_folders", []), data_dir())

    def _downloaded(self, path: Path) -> None:
        """A finished download joins the library now, and its folder is scanned from now on."""
        library = self.window_.library
        folder = str(self.download_folder())
        if folder not in library.folders:
            library.folders.append(folder)
            library.folders_changed.emit(library.folders)  # saved in the settings, as "Add folder…"
        library.add_file(path)

    def _renamed(self, conv_id: str, title: str) -> None:
        chat = self.window_.chat
        if chat.conv.id == conv_id:
            chat.conv.title = title  # the open chat saves this title from now on, not the old one
        chat.refresh_conversations()

    def _open_conversation(self, conv_id: str) -> None:
        self.window_.chat.refresh_conversations()
        self.window_.chat.open_conversation(conv_id)
        self.window_.show_page("chat")

    def shutdown(self) -> None:
        """Window closing: stop polling, stop serving, cancel downloads (their parts stay)."""
        self.telemetry.stop()
        self.server.shutdown()
        self.download.shutdown()
        self.conversations.shutdown()


__all__ = ["Cockpit", "TABS"]
