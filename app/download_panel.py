"""The Download panel: search Hugging Face for GGUF repositories, see each file's size and whether it fits
this machine (an estimate from the size for every file, then the planner's plan and predicted tokens/s
from the header of the file picked), download one with progress and Cancel (a later Download resumes),
and hand the finished file to the library.

Every network call runs in a `Job` thread (app/jobs.py); the GUI thread only starts jobs and reacts to
their signals, and progress reaches it at most ten times a second however fast the bytes arrive.

Not here: the Hub calls, the resume and checks (app/download.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from minecart.engine.devices import DeviceInfo, format_bytes
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from . import download as dl
from .jobs import Job


class DownloadPanel(QWidget):
    """`devices()` gives this machine's devices (for the fit column); `folder()` where files go."""

    downloaded = Signal(object)  # Path of a finished file

    def __init__(self, devices: Callable[[], list[DeviceInfo]], folder: Callable[[], Path],
                 context: Callable[[], int] = lambda: 4096, parent=None):
        super().__init__(parent)
        self._devices = devices
        self._folder = folder
        self._context = context
        self.files: list[dl.RemoteFile] = []
        # the planner's verdict per (repo, path): (text, tooltip); computed for a file when it is picked
        self.plans: dict[tuple[str, str], tuple[str, str]] = {}
        self._plan_job: Job | None = None
        self._plan_next: dl.RemoteFile | None = None
        self.job: Job | None = None
        self._job_writes = False  # the current job writes a part file: it must stop before another
        self._jobs: set[Job] = set()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.setSpacing(8)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search Hugging Face for GGUF models, or type owner/name")
        self.query.returnPressed.connect(self.search)
        row.addWidget(self.query, 1)
        self.search_btn = QPushButton("Search")
        self.search_btn.clicked.connect(self.search)
        row.addWidget(self.search_btn)
        lay.addLayout(row)
        split = QSplitter(Qt.Orientation.Vertical)
        self.repos = QListWidget()
        self.repos.currentTextChanged.connect(self.list_files)
        split.addWidget(self.repos)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["File", "Size", "On this machine"])
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.doubleClicked.connect(lambda _: self.start_download())
        split.addWidget(self.table)
        split.setSizes([120, 340])
        lay.addWidget(split, 1)
        bottom = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setVisible(False)
        bottom.addWidget(self.progress, 1)
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.clicked.connect(self.cancel)
        self.cancel_btn.setVisible(False)
        bottom.addWidget(self.cancel_btn)
        self.download_btn = QPushButton("Download")
        self.download_btn.setObjectName("Primary")
        self.download_btn.clicked.connect(self.start_download)
        bottom.addWidget(self.download_btn)
        lay.addLayout(bottom)
        self.status = QLabel(f"Files go to {self._folder()}")
        self.status.setObjectName("Subtle")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self.error = QLabel("")
        self.error.setObjectName("ErrorText")
        self.error.setWordWrap(True)
        lay.addWidget(self.error)
        self._update_buttons()

    # ---- jobs ------------------------------------------------------------------------------------
    def _start(self, work: Callable, on_done: Callable, busy_text: str) -> Job:
        job = Job(work, cancel_types=(dl.DownloadCancelled,), error_types=(dl.DownloadError,),
                  parent=self)
        # a search or listing left behind by Cancel may still answer: only the current job is shown
        job.finished_ok.connect(lambda result: on_done(result) if job is self.job else None)
        job.failed.connect(lambda text: self._failed(text) if job is self.job else None)
        job.cancelled.connect(self._cancelled)
        job.finished.connect(lambda: self._job_over(job))
        self._jobs.add(job)
        self.job = job
        self._job_writes = False
        self.error.setText("")
        self.status.setText(busy_text)
        self.cancel_btn.setVisible(True)
        self._update_buttons()
        job.start()
        return job

    def _job_over(self, job: Job) -> None:
        self._jobs.discard(job)
        if self.job is not job:
            return  # a cancelled search finishing late
        self.job = None
        self.progress.setVisible(False)
        self.cancel_btn.setVisible(False)
        self._update_buttons()

    def _failed(self, text: str) -> None:
        self.error.setText(text)
        self.status.setText(f"Files go to {self._folder()}")

    def _cancelled(self) -> None:
        self.status.setText("Download cancelled; press Download to resume where it stopped.")

    def cancel(self) -> None:
        """A download stops at its next chunk and keeps its part. A search or listing cannot be
        interrupted inside huggingface_hub (it retries an unreachable Hub for ~20 s), so it is left
        to finish in the background and its answer is dropped."""
        job = self.job
        if job is None:
            return
        job.cancel.set()
        if not self._job_writes:
            self.job = None
            self.status.setText("Cancelled.")
            self.cancel_btn.setVisible(False)
            self._update_buttons()

    def busy(self) -> bool:
        return self.job is not None

    def _update_buttons(self) -> None:
        idle = self.job is None
        self.search_btn.setEnabled(idle)
        self.download_btn.setEnabled(idle and self.selected_file() is not None)

    # ---- search and list -------------------------------------------------------------------------
    def search(self) -> None:
        if self.busy():
            return
        text = self.query.text().strip()
        self._start(lambda progress, cancel: dl.search_repos(text), self._show_repos,
                    f"Searching for {text!r}…")

    def _show_repos(self, repos: list) -> None:
        text = self.query.text().strip()
        if text.count("/") == 1 and text not in repos:
            repos = [text, *repos]  # a typed id is listed even when search does not rank it
        self.repos.clear()
        self.repos.addItems(repos)
        self.status.setText(f"{len(repos)} repositor{'y' if len(repos) == 1 else 'ies'}; pick one to "
                            "see its GGUF files" if repos else "No GGUF repository matches.")

    def list_files(self, repo: str) -> None:
        if not repo or self.busy():
            return
        self._start(lambda progress, cancel: dl.list_gguf_files(repo), self._show_files,
                    f"Listing {repo}…")

    def _show_files(self, files: list) -> None:
        self.files = files
        devices = self._devices()
        self.table.setRowCount(len(files))
        for i, f in enumerate(files):
            fit, tip = "vision projector", "the picture half of a vision model; it goes beside the model"
            if not f.is_mmproj:
                fit, tip = self.plans.get((f.repo, f.path)) or (
                    dl.fit_text(f.size, devices), "an estimate from the file size; select the file for "
                    "the plan and speed from its header")
            for col, text in enumerate((f.path, format_bytes(f.size), fit)):
                item = QTableWidgetItem(text)
                item.setToolTip(tip if col == 2 else text)
                self.table.setItem(i, col, item)
        self.status.setText(f"{len(files)} GGUF file{'s' if len(files) != 1 else ''}; files go to "
                            f"{self._folder()}" if files else "This repository has no GGUF files.")
        self._update_buttons()

    # ---- the planner's verdict for the picked file --------------------------------------------------
    def _selection_changed(self) -> None:
        self._update_buttons()
        f = self.selected_file()
        if f is not None and not f.is_mmproj and (f.repo, f.path) not in self.plans:
            self.plan(f)

    def plan(self, f: dl.RemoteFile) -> None:
        """Fetch `f`'s header and plan it on this machine (one plan at a time; the latest pick waits)."""
        if self._plan_job is not None:
            self._plan_next = f
            return
        self._set_fit(f, "planning from the file's header…", "")
        devices, context = self._devices(), self._context()
        job = Job(lambda progress, cancel: dl.plan_fit(f, devices, context, cancel),
                  cancel_types=(dl.DownloadCancelled,), error_types=(dl.DownloadError,), parent=self)
        job.finished_ok.connect(lambda fit: self._planned(f, fit.text, fit.detail or fit.text))
        job.failed.connect(lambda text: self._planned(f, "cannot plan", text))
        job.finished.connect(lambda: self._plan_over(job))
        self._jobs.add(job)
        self._plan_job = job
        job.start()

    def _planned(self, f: dl.RemoteFile, text: str, tip: str) -> None:
        self.plans[(f.repo, f.path)] = (text, tip)
        self._set_fit(f, text, tip)

    def _plan_over(self, job: Job) -> None:
        self._jobs.discard(job)
        self._plan_job = None
        f, self._plan_next = self._plan_next, None
        if f is not None and (f.repo, f.path) not in self.plans:
            self.plan(f)

    def _set_fit(self, f: dl.RemoteFile, text: str, tip: str) -> None:
        for i, g in enumerate(self.files):
            if g == f and self.table.item(i, 2) is not None:
                self.table.item(i, 2).setText(text)
                self.table.item(i, 2).setToolTip(tip or text)

    def selected_file(self) -> dl.RemoteFile | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows or rows[0].row() >= len(self.files):
            return None
        return self.files[rows[0].row()]

    # ---- download --------------------------------------------------------------------------------
    def start_download(self) -> None:
        f = self.selected_file()
        if f is None or self.busy():
            return
        folder = self._folder()
        job = self._start(lambda progress, cancel: dl.download(f, folder, progress, cancel),
                          self._finished, f"Downloading {f.name}…")
        self._job_writes = True
        job.progress.connect(self._progress)
        self.progress.setValue(0)
        self.progress.setVisible(True)

    def _progress(self, done: int, total: int) -> None:
        self.progress.setValue(int(1000 * done / total) if total else 0)
        self.progress.setFormat(f"{format_bytes(done)} of {format_bytes(total)}")

    def _finished(self, path: Path) -> None:
        self.status.setText(f"Downloaded to {path}")
        self.downloaded.emit(Path(path))

    def shutdown(self) -> None:
        """Cancel and wait for every job (window closing); a download's part stays for next time."""
        for job in list(self._jobs):
            job.cancel.set()
            job.wait(5000)


__all__ = ["DownloadPanel"]
