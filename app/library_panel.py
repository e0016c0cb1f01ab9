"""The model library page: every GGUF found (your folders, LM Studio, llama.cpp and Hugging Face caches,
the demo model) in a table with architecture, parameters, quant mix, file size and context length.

Scanning runs on a QThread (`ScanThread`) over `engine.model_library.scan`, which reads only headers;
a broken file becomes a row with its error text. Double-click or "Load" asks the window to load a row.
"""

from __future__ import annotations

import threading
from pathlib import Path

from minecart.engine import model_library as ml
from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QSize,
    QSortFilterProxyModel,
    Qt,
    QThread,
    Signal,
)
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from . import theme

COLUMNS = ["Model", "Architecture", "Params", "Quantization", "Size", "Context", "Where"]
SUMMARY_ROLE = Qt.ItemDataRole.UserRole + 10


class LibraryModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[ml.ModelSummary] = []

    def set_rows(self, rows: list[ml.ModelSummary]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def add(self, s: ml.ModelSummary) -> int:
        for i, r in enumerate(self.rows):
            if r.path == s.path:
                self.rows[i] = s
                self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))
                return i
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows))
        self.rows.append(s)
        self.endInsertRows()
        return len(self.rows) - 1

    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()):
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        s = self.rows[index.row()]
        col = index.column()
        if role == SUMMARY_ROLE:
            return s
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 0:
                tags = []
                if s.is_mmproj:
                    tags.append("vision projector")
                elif s.has_vision:
                    tags.append("vision")
                if s.split:
                    tags.append(f"part {s.split}")
                name = s.display_name if s.ok else s.path.name
                return name + (f"   [{', '.join(tags)}]" if tags else "")
            if not s.ok:
                return "unreadable" if col == 1 else ""  # the reason shows under the file name
            quant = f"{s.file_type}  ({s.quant_text})" if s.file_type and s.quant_text else s.quant_text
            return [None, s.architecture, s.params_text, quant, ml.format_size(s.file_size),
                    f"{s.context_length:,}" if s.context_length else "", s.source][col]
        if role == Qt.ItemDataRole.ToolTipRole:
            tip = f"{s.path}"
            if s.error:
                tip += f"\n{s.error}"
            if s.mmproj_path:
                tip += f"\nvision projector: {s.mmproj_path.name}"
            return tip
        if role == Qt.ItemDataRole.ForegroundRole:
            if not s.ok and col == 1:
                return QColor("#ff8a80")
            if col in (5, 6) or (s.is_mmproj and col == 0):
                return QColor(theme.MUTED)
        if role == Qt.ItemDataRole.UserRole:  # sort keys
            return [s.display_name.lower(), s.architecture, s.n_params, s.file_type, s.file_size,
                    s.context_length, s.source][col]
        return None


class ScanThread(QThread):
    """Runs the folder scan off the GUI thread; `found` carries the list of summaries."""

    found = Signal(list)

    def __init__(self, folders, include_defaults=True, include_demo=True, parent=None):
        super().__init__(parent)
        self.folders = list(folders)
        self.include_defaults = include_defaults
        self.include_demo = include_demo
        self.cancel = threading.Event()

    def run(self):
        try:
            rows = ml.scan(self.folders, include_defaults=self.include_defaults, include_demo=self.include_demo,
                           cancel=self.cancel)
        except Exception as exc:  # scan() should not raise; if it does, show it as a row
            rows = [ml.ModelSummary(path=Path("scan"), error=f"scan failed: {exc}")]
        self.found.emit(rows)


class SummaryThread(QThread):
    """Reads one file's header off the GUI thread (a big model's tensor table takes up to a second)."""

    done = Signal(object)  # ModelSummary

    def __init__(self, path, parent=None):
        super().__init__(parent)
        self.path = Path(path)

    def run(self):
        s = ml.summarize(self.path, source="Opened")  # never raises: problems go into .error
        if s.ok and not s.is_mmproj:
            s.mmproj_path = ml._find_mmproj(self.path)
        self.done.emit(s)


class LibraryPanel(QWidget):
    load_requested = Signal(object)  # Path
    selection_changed = Signal(object)  # ModelSummary or None
    folders_changed = Signal(list)
    file_added = Signal(object)  # the ModelSummary of a file opened with add_file, once it is read

    def __init__(self, folders: list[str] | None = None, include_defaults: bool = True, include_demo: bool = True,
                 parent=None):
        super().__init__(parent)
        self.folders = list(folders or [])
        self.include_defaults = include_defaults
        self.include_demo = include_demo
        self.scan_thread: ScanThread | None = None
        self.summary_threads: set[SummaryThread] = set()
        self._load_when_added: Path | None = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 18, 24, 18)
        lay.setSpacing(12)
        top = QHBoxLayout()
        tb = QVBoxLayout()
        title = QLabel("Models")
        title.setObjectName("PageTitle")
        tb.addWidget(title)
        self.status = QLabel("Looking for GGUF files…")
        self.status.setObjectName("Subtle")
        tb.addWidget(self.status)
        top.addLayout(tb)
        top.addStretch(1)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter…")
        self.filter.setMinimumWidth(120)
        self.filter.setMaximumWidth(220)
        self.filter.setClearButtonEnabled(True)
        top.addWidget(self.filter)
        self.open_btn = QPushButton(theme.icon("file"), " Open file…")
        self.folder_btn = QPushButton(theme.icon("folder"), " Add folder…")
        self.rescan_btn = QPushButton(theme.icon("refresh"), " Rescan")
        for b in (self.open_btn, self.folder_btn, self.rescan_btn):
            top.addWidget(b)
        self.load_btn = QPushButton(theme.icon("play", "#1a1307"), " Load")
        self.load_btn.setObjectName("Primary")
        self.load_btn.setEnabled(False)
        top.addWidget(self.load_btn)
        lay.addLayout(top)

        self.model = LibraryModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(Qt.ItemDataRole.UserRole)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.proxy.setFilterKeyColumn(-1)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setAlternatingRowColors(True)
        self.table.setShowGrid(False)
        self.table.setSortingEnabled(True)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(46)
        self.table.setItemDelegateForColumn(0, NameDelegate(self.table))
        self.table.setWordWrap(False)
        hh = self.table.horizontalHeader()
        # the name and the (long) quant mix share the room; at 960 px the name had 40 px left
        for c in range(len(COLUMNS)):
            stretch = COLUMNS[c] in ("Model", "Quantization")
            hh.setSectionResizeMode(c, QHeaderView.ResizeMode.Stretch if stretch
                                    else QHeaderView.ResizeMode.ResizeToContents)
        hh.setHighlightSections(False)
        hh.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        lay.addWidget(self.table, 1)
        self.places = QLabel()
        self.places.setObjectName("Subtle")
        self.places.setWordWrap(True)
        lay.addWidget(self.places)
        self._show_places()

        self.filter.textChanged.connect(self.proxy.setFilterFixedString)
        self.open_btn.clicked.connect(self._open_file)
        self.folder_btn.clicked.connect(self._add_folder)
        self.rescan_btn.clicked.connect(self.rescan)
        self.load_btn.clicked.connect(self._load_selected)
        self.table.doubleClicked.connect(lambda _: self._load_selected())
        self.table.selectionModel().selectionChanged.connect(self._selection)

    def _show_places(self) -> None:
        places = [str(p) for _, p in ml.default_locations() if p.is_dir()] if self.include_defaults else []
        places += self.folders
        first = "Searched: demo model" if self.include_demo else "Searched"
        self.places.setText(first + ("; " + "; ".join(places) if places else "") +
                            ". Add folders with “Add folder…”; open any .gguf with “Open file…”.")

    def rescan(self) -> None:
        if self.scan_thread is not None and self.scan_thread.isRunning():
            return
        self.status.setText("Scanning…")
        self.rescan_btn.setEnabled(False)
        self.scan_thread = ScanThread(self.folders, self.include_defaults, self.include_demo, parent=self)
        self.scan_thread.found.connect(self._scanned)
        self.scan_thread.start()

    def _scanned(self, rows: list) -> None:
        selected = self.selected()
        extra = [r for r in self.model.rows if r.source == "Opened" and all(r.path != x.path for x in rows)]
        self.model.set_rows(rows + extra)
        ok = sum(1 for r in rows if r.ok and not r.is_mmproj)
        bad = sum(1 for r in rows if not r.ok)
        self.status.setText(f"{ok} model{'s' if ok != 1 else ''} found" + (f", {bad} unreadable" if bad else ""))
        self.rescan_btn.setEnabled(True)
        self._show_places()
        if selected is not None:
            self.select_path(selected.path)

    def add_file(self, path) -> None:
        """Read a file's header on a thread, then list and select it (`file_added` says when)."""
        th = SummaryThread(path, self)
        th.done.connect(self._file_read)
        th.finished.connect(lambda: self.summary_threads.discard(th))
        self.summary_threads.add(th)
        th.start()

    def _file_read(self, s: ml.ModelSummary) -> None:
        self.model.add(s)
        self.select_path(s.path)
        self.file_added.emit(s)
        if self._load_when_added == s.path:
            self._load_when_added = None
            if s.ok and not s.is_mmproj:
                self.load_requested.emit(s.path)

    def select_path(self, path) -> bool:
        path = Path(path)
        for r, s in enumerate(self.model.rows):
            if s.path == path:
                idx = self.proxy.mapFromSource(self.model.index(r, 0))
                self.table.selectRow(idx.row())
                return True
        return False

    def selected(self) -> ml.ModelSummary | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return None
        return self.proxy.data(rows[0], SUMMARY_ROLE)

    def _selection(self, *_):
        s = self.selected()
        self.load_btn.setEnabled(bool(s and s.ok and not s.is_mmproj))
        self.selection_changed.emit(s)

    def _open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", str(Path.home()), "GGUF models (*.gguf)")
        if path:
            self._load_when_added = Path(path)
            self.add_file(path)

    def _add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a model folder", str(Path.home()))
        if folder and folder not in self.folders:
            self.folders.append(folder)
            self.folders_changed.emit(self.folders)
            self.rescan()

    def _load_selected(self) -> None:
        s = self.selected()
        if s is not None and s.ok and not s.is_mmproj:
            self.load_requested.emit(s.path)


class NameDelegate(QStyledItemDelegate):
    """Model column: the model's name, and under it the file name (several files often share a name)."""

    def sizeHint(self, option, index):
        return QSize(320, 44)

    def paint(self, painter, option, index):
        s = index.data(SUMMARY_ROLE)
        if s is None:
            return super().paint(painter, option, index)
        self.initStyleOption(option, index)
        option.text = ""
        option.widget.style().drawControl(QStyle.ControlElement.CE_ItemViewItem, option, painter, option.widget)
        r = option.rect.adjusted(10, 4, -8, -4)
        painter.save()
        top = index.data(Qt.ItemDataRole.DisplayRole) or ""
        f = QFont(option.font)
        f.setWeight(QFont.Weight.DemiBold)
        painter.setFont(f)
        painter.setPen(QColor(theme.MUTED if s.is_mmproj else theme.TEXT))
        fm = painter.fontMetrics()
        painter.drawText(r.adjusted(0, 0, 0, -r.height() // 2), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         fm.elidedText(top, Qt.TextElideMode.ElideRight, r.width()))
        f2 = QFont(option.font)
        f2.setPointSizeF(max(7.5, option.font.pointSizeF() - 1.5))
        painter.setFont(f2)
        painter.setPen(QColor("#ff8a80" if not s.ok else theme.MUTED))
        sub = s.path.name if s.ok else s.error
        painter.drawText(r.adjusted(0, r.height() // 2, 0, 0), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         painter.fontMetrics().elidedText(sub, Qt.TextElideMode.ElideMiddle, r.width()))
        painter.restore()
