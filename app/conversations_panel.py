"""The Conversations panel: find a saved chat by any word in it, open it, rename it, export it as
Markdown or JSON.

Searching reads every conversation file, so it runs as a `Job` (app/jobs.py) a moment after typing
stops; a newer search replaces an older one's answer. Rename and export touch one file and run at once.
Asks for a title or a file name through dialogs; `rename_selected` and `export_selected` do the work
(and are what tests call).

Not here: the search and export rules (app/conversation_tools.py) or the storage (app/conversations.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from . import conversation_tools as ct
from .conversations import ConversationStore
from .jobs import Job

SEARCH_DELAY_MS = 200


class ConversationsPanel(QWidget):
    open_requested = Signal(str)  # conversation id
    renamed = Signal(str, str)  # conversation id, new title

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        self.hits: list[ct.Hit] = []
        self.job: Job | None = None
        self._jobs: set[Job] = set()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.setSpacing(8)
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search every conversation (title, questions, answers)")
        self.query.setClearButtonEnabled(True)
        lay.addWidget(self.query)
        self.results = QListWidget()
        self.results.setObjectName("ConversationList")
        self.results.setWordWrap(True)
        self.results.itemDoubleClicked.connect(lambda _: self.open_selected())
        self.results.currentRowChanged.connect(lambda _: self._update_buttons())
        lay.addWidget(self.results, 1)
        row = QHBoxLayout()
        self.open_btn = QPushButton("Open")
        self.open_btn.clicked.connect(self.open_selected)
        self.rename_btn = QPushButton("Rename…")
        self.rename_btn.clicked.connect(self._ask_rename)
        self.md_btn = QPushButton("Export Markdown…")
        self.md_btn.clicked.connect(lambda: self._ask_export(".md"))
        self.json_btn = QPushButton("Export JSON…")
        self.json_btn.clicked.connect(lambda: self._ask_export(".json"))
        for b in (self.open_btn, self.rename_btn, self.md_btn, self.json_btn):
            row.addWidget(b)
        row.addStretch(1)
        lay.addLayout(row)
        self.status = QLabel("")
        self.status.setObjectName("Subtle")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self._delay = QTimer(self)
        self._delay.setSingleShot(True)
        self._delay.setInterval(SEARCH_DELAY_MS)
        self._delay.timeout.connect(self.search)
        self.query.textChanged.connect(lambda _: self._delay.start())
        self._update_buttons()

    # ---- search --------------------------------------------------------------------------------------
    def search(self) -> None:
        query, store = self.query.text(), self.store
        job = Job(lambda progress, cancel: ct.search(store.list(), query), parent=self)
        job.finished_ok.connect(lambda hits: self._show(hits, query) if job is self.job else None)
        job.failed.connect(lambda text: self.status.setText(f"Search failed: {text}"))
        job.finished.connect(lambda: self._jobs.discard(job))
        self._jobs.add(job)
        self.job = job
        job.start()

    def busy(self) -> bool:
        return any(j.isRunning() for j in self._jobs)

    def _show(self, hits: list, query: str) -> None:
        keep = self.selected_id()
        self.hits = hits
        self.results.clear()
        for h in hits:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(h.updated))
            it = QListWidgetItem(f"{h.title}\n{h.snippet or when}")
            it.setData(Qt.ItemDataRole.UserRole, h.conv_id)
            it.setToolTip(f"{h.title} · {when}")
            self.results.addItem(it)
            if h.conv_id == keep:
                self.results.setCurrentItem(it)
        n = len(hits)
        self.status.setText(f"{n} conversation{'s' if n != 1 else ''}"
                            + (f" mention {query.strip()!r}" if query.strip() else ""))
        self._update_buttons()

    def selected_id(self) -> str | None:
        it = self.results.currentItem()
        return it.data(Qt.ItemDataRole.UserRole) if it is not None else None

    def _update_buttons(self) -> None:
        on = self.selected_id() is not None
        for b in (self.open_btn, self.rename_btn, self.md_btn, self.json_btn):
            b.setEnabled(on)

    # ---- actions -------------------------------------------------------------------------------------
    def open_selected(self) -> None:
        cid = self.selected_id()
        if cid is not None:
            self.open_requested.emit(cid)

    def _ask_rename(self) -> None:
        cid = self.selected_id()
        if cid is None:
            return
        current = next((h.title for h in self.hits if h.conv_id == cid), "")
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title", text=current)
        if ok:
            self.rename_selected(title)

    def rename_selected(self, title: str) -> bool:
        cid = self.selected_id()
        if cid is None:
            return False
        try:
            conv = ct.rename(self.store, cid, title)
        except (OSError, ValueError) as exc:
            self.status.setText(f"Not renamed: {exc}")
            return False
        self.status.setText(f"Renamed to {conv.title!r}")
        self.renamed.emit(cid, conv.title)
        self.search()
        return True

    def _ask_export(self, suffix: str) -> None:
        cid = self.selected_id()
        if cid is None:
            return
        title = next((h.title for h in self.hits if h.conv_id == cid), "conversation")
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "conversation"
        kind = "Markdown (*.md)" if suffix == ".md" else "JSON (*.json)"
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / (safe + suffix)),
                                              kind)
        if path:
            self.export_selected(path)

    def export_selected(self, path: str | Path) -> Path | None:
        cid = self.selected_id()
        if cid is None:
            return None
        try:
            out = ct.export(self.store.load(cid), path)
        except (OSError, ValueError) as exc:
            self.status.setText(f"Not exported: {exc}")
            return None
        self.status.setText(f"Exported to {out}")
        return out

    def shutdown(self) -> None:
        for job in list(self._jobs):
            job.wait(3000)


__all__ = ["ConversationsPanel"]
