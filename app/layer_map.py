"""The layer map: every part of the model (embedding, each layer, LM head) as a block, grouped per
device, with a memory bar per device; drag blocks (or a boundary) onto another device, Auto-split, Apply.

`LayerMapModel` is a QAbstractItemModel over an engine `Placement` (engine/placement.py): top-level rows
are devices, their children the parts placed on them. Drag flags, MIME encoding and drops live in the
model, so any view (and the keyboard) edits the plan the same way. `LayerMapPanel` shows one
`DeviceLane` per device; each lane is a QListView on the shared model rooted at its device row.
Every edit is one step of the model's QUndoStack (Ctrl+Z / Ctrl+Shift+Z).
The plan on screen is the plan that runs: Load and Reload hand it to the engine, Apply re-places the
loaded model with it (MainWindow), and after a load the map shows the engine's placement.
Under the title the panel shows the plan's predicted decode and prefill tokens/s (engine predict_speed,
each card priced from its resources/gpu_profiles.json profile; a card without one is named instead of
guessed), recomputed on every edit. For an MoE model, "Experts in host RAM" puts every layer's routed
experts on the CPU, and each MoE layer's routed experts are a block of their own ("X12", beside their
layer, or in the CPU's lane when in host RAM) that drags to the CPU and back, as a block's context menu
moves the experts of the selected layers alone
(Placement.experts, "layer.N" -> device; a layer marked "+X" keeps its experts on the host, and
their GPU streams them through two staging buffers for prefill); the lanes and the prediction follow.
A GPU's "Use" box leaves the card out of automatic plans (`LayerMapModel.excluded`: Auto-split, and the
first plan of a model the window selects); unticking a card that holds layers re-plans on the others.

Not here: loading, or planning beyond the engine's own placement functions.
"""

from __future__ import annotations

import json

from minecart.engine import KV_TYPES, gpu_profiles
from minecart.engine import placement as pl
from minecart.engine.devices import DeviceInfo, format_bytes
from minecart.engine.rig import device_spec as rig_device_spec
from PySide6.QtCore import (
    QAbstractItemModel,
    QByteArray,
    QMimeData,
    QModelIndex,
    QPoint,
    QRectF,
    QSize,
    Qt,
    Signal,
)
from PySide6.QtGui import (
    QAction,
    QColor,
    QFont,
    QKeySequence,
    QPainter,
    QPainterPath,
    QPen,
    QUndoCommand,
    QUndoStack,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListView,
    QMenu,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QStyle,
    QStyledItemDelegate,
    QVBoxLayout,
    QWidget,
)

from . import theme
from .jobs import Job

MIME_PARTS = "application/x-minecart-parts"

KIND_ROLE = Qt.ItemDataRole.UserRole + 1
PART_INDEX_ROLE = Qt.ItemDataRole.UserRole + 2
DEVICE_ID_ROLE = Qt.ItemDataRole.UserRole + 3
BYTES_ROLE = Qt.ItemDataRole.UserRole + 4

KIND_NAMES = {"embedding": "Token embedding", "head": "LM head (output norm + projection)",
              "gdn": "Gated DeltaNet layer (recurrent state, no KV cache)",
              "attention": "Full attention layer (KV cache)", "sliding": "Sliding-window attention layer"}


# The KV cache types offered are the ones the engine runs (load_model(kv_type=)); the default is the
# engine's (f16), and the type on screen is always passed to the engine.
DEFAULT_KV_TYPE = pl.DEFAULT_KV_TYPE
KV_TYPE_TIPS = {
    "f32": "f32: exact, 4 bytes per value",
    "f16": "f16: half precision, 2 bytes per value, half the f32 cache (the default, as in llama.cpp)",
    "q8_0": "q8_0: 8-bit codes + one fp16 scale per 32 values, 1.06 bytes per value, 3.8x smaller than f32",
    "q3": "q3: 3-bit codes + one fp16 scale per 32 values, 9x smaller than f32. Costs a little accuracy: "
          "on the test models the logits differ from f32 by ~2% (about what Q8_0 weights cost), the top "
          "token agrees at 97-100% of positions; the first tokens of a sequence differ most",
}


def runnable_kv_type(kv_type: str | None) -> str:
    """`kv_type` if the engine runs it, else the default (the engine's)."""
    return kv_type if kv_type in KV_TYPES else DEFAULT_KV_TYPE


def runnable_plan(plan: pl.Placement | None) -> pl.Placement | None:
    """The plan as the engine runs it (a copy when it had to change): a KV cache type the engine runs,
    and, where a GPU layer's routed experts sit in host RAM, prefill runs of at least
    placement.STREAMED_EXPERTS_CHUNK tokens, as load_model runs them, so the cards' activation memory
    and the predicted prefill are priced for those runs. (Moved back, the experts leave the longer
    runs in place: the engine runs the plan's chunk, and the map prices it.)"""
    if plan is None:
        return None
    if plan.kv_type not in KV_TYPES:
        plan = plan.with_settings(kv_type=DEFAULT_KV_TYPE)
    if plan.chunk < pl.STREAMED_EXPERTS_CHUNK and any(plan.streamed_parts(d) for d in plan.devices_used()):
        plan = plan.with_settings(chunk=pl.STREAMED_EXPERTS_CHUNK)
    return plan


def card_profile(dev: DeviceInfo) -> gpu_profiles.CardProfile | None:
    """The resources/gpu_profiles.json profile of a GPU, by the name its driver gives it; None for the
    CPU and for cards the table does not list."""
    return gpu_profiles.find(dev.name) if dev.kind == "cuda" else None


def device_spec(dev: DeviceInfo) -> pl.DeviceSpec:
    """What placement needs to know about a device (engine rig.device_spec: name, bytes, speed and link
    of a known card); a device that does not report its free memory counts its total."""
    free = dev.free_bytes if dev.free_bytes >= 0 else max(dev.total_bytes, 0)
    return rig_device_spec(dev, free)


def format_rate(tokens_per_s: float) -> str:
    """Tokens/s for people: one decimal below 10, whole numbers with thousands separators above."""
    return f"{tokens_per_s:.1f}" if tokens_per_s < 10 else f"{tokens_per_s:,.0f}"


# Auto-split jobs still running, held here so none is destroyed mid-run with the model that started it.
_RUNNING_JOBS: set[Job] = set()


def _forget(job: Job) -> None:
    # 'finished' is emitted just before the thread ends: let it end before the last reference goes,
    # or the QThread is destroyed while still running (Qt aborts the process)
    job.wait()
    _RUNNING_JOBS.discard(job)


def wait_for_planning(timeout_ms: int = 3000) -> None:
    """Let running auto-split jobs finish (the window calls this as it closes)."""
    for job in list(_RUNNING_JOBS):
        job.wait(timeout_ms)


class LayerMapModel(QAbstractItemModel):
    """Devices (top level) and the parts on each (children), over a mutable engine Placement."""

    plan_changed = Signal()
    auto_split_running = Signal(bool)  # an auto-split is being planned on a worker thread
    auto_split_failed = Signal(str)
    exclusion_changed = Signal()  # a card was left out of automatic plans, or taken back in

    def __init__(self, devices: list[DeviceInfo], parent=None):
        super().__init__(parent)
        self.devices = list(devices)
        self.plan: pl.Placement | None = None
        self.keep_contiguous = True
        self._children: list[list[int]] = [[] for _ in self.devices]
        self.undo_stack = QUndoStack(self)  # every edit of the plan, for Ctrl+Z / Ctrl+Shift+Z
        self._auto_seq = 0  # the newest auto-split asked for; an older one's result is dropped
        self._auto_base: pl.Placement | None = None  # the plan that newest auto-split started from
        self.excluded: set[str] = set()  # GPUs the user left out: automatic plans do not use them

    # ---- data in and out ----------------------------------------------------------------------------
    def set_devices(self, devices: list[DeviceInfo]) -> None:
        self.beginResetModel()
        self.devices = list(devices)
        self._rebuild()
        self.endResetModel()

    def set_plan(self, plan: pl.Placement | None) -> None:
        """Show a new plan (another model's, or where the engine placed this one): edits before it
        can no longer be undone."""
        self.undo_stack.clear()
        self._show(plan)

    def _show(self, plan: pl.Placement | None) -> None:
        self.beginResetModel()
        self.plan = runnable_plan(plan.copy() if plan is not None else None)
        plan = self.plan
        # a saved plan may name a device that is gone; it still shows (as a lane) so the user can move off it
        if plan is not None:
            known = {d.id for d in self.devices}
            for dev in plan.devices_used():
                if dev not in known:
                    self.devices.append(DeviceInfo(id=dev, kind="missing", name=f"{dev} (not present)",
                                                   total_bytes=0, used_bytes=0, free_bytes=0))
        self._rebuild()
        self.endResetModel()
        self.plan_changed.emit()

    def _rebuild(self) -> None:
        """Each device row's children: the parts placed on it, in order, each MoE layer followed by its
        routed experts' block where they sit with it; the experts kept apart from their layer (host
        RAM) as blocks under the device holding them. A child is a code: a part index, or n_parts + i
        for the routed experts of part i (expert_part)."""
        self._children = [[] for _ in self.devices]
        if self.plan is None:
            return
        n = len(self.plan.assignment)
        row_of = {d.id: r for r, d in enumerate(self.devices)}
        apart = []
        for i, dev in enumerate(self.plan.assignment):
            if dev in row_of:
                self._children[row_of[dev]].append(i)
            if self.plan.costs.parts[i].experts:
                if self.plan.experts_of(i) == dev:
                    if dev in row_of:
                        self._children[row_of[dev]].append(n + i)
                else:
                    apart.append(i)
        for i in apart:
            dev = self.plan.experts_of(i)
            if dev in row_of:
                self._children[row_of[dev]].append(n + i)

    def expert_part(self, code: int) -> int | None:
        """The part whose routed experts child `code` is (its experts' block), or None for a part."""
        n = len(self.plan.assignment) if self.plan is not None else 0
        return code - n if code >= n else None

    def layer_of(self, code: int) -> int:
        """The part a child stands for: itself, or the layer whose routed experts' block it is."""
        e = self.expert_part(code)
        return code if e is None else e

    def device_specs(self) -> list[pl.DeviceSpec]:
        return [device_spec(d) for d in self.devices if d.kind != "missing"]

    def planning_devices(self) -> list[DeviceInfo]:
        """The devices a new plan may use (Auto-split, a selected model's first plan, the download page's
        fit): those present, less the GPUs the user left out."""
        return [d for d in self.devices if d.kind != "missing" and d.id not in self.excluded]

    def auto_specs(self) -> list[pl.DeviceSpec]:
        return [device_spec(d) for d in self.planning_devices()]

    def _is_cpu(self, device: str) -> bool:
        return any(d.id == device and d.kind == "cpu" for d in self.devices)

    def set_excluded(self, device_id: str, excluded: bool) -> bool:
        """Leave a GPU out of automatic plans (Auto-split, a new model's first plan) or take it back in.
        Leaving out a card that holds part of the plan re-plans on the others at once (an Auto-split,
        one undo step). Only GPUs can be left out: the CPU is where everything else goes. False when
        nothing changed."""
        dev = next((d for d in self.devices if d.id == device_id), None)
        if dev is None or dev.kind != "cuda" or (device_id in self.excluded) == excluded:
            return False
        if excluded:
            self.excluded.add(device_id)
        else:
            self.excluded.discard(device_id)
        self.exclusion_changed.emit()
        if excluded and self.plan is not None and device_id in self.plan.devices_holding():
            self.auto_split_later()
        return True

    def bytes_per_device(self) -> dict[str, pl.DeviceBytes]:
        return self.plan.bytes_per_device() if self.plan is not None else {}

    def issues(self) -> list[pl.PlanIssue]:
        if self.plan is None:
            return []
        return pl.validate(self.plan, self.device_specs())

    def overflowing(self) -> list[str]:
        return [i.device for i in self.issues() if i.severity == "error" and i.device]

    # ---- speed and experts --------------------------------------------------------------------------
    def unpriced_cards(self) -> list[str]:
        """Names of the GPUs holding part of the plan whose speed nobody knows (no profile, or a card
        that is gone): a prediction with them in it would be a guess."""
        if self.plan is None:
            return []
        by_id = {d.id: d for d in self.devices}
        out = []
        for dev_id in self.plan.devices_holding():
            dev = by_id.get(dev_id)
            if dev is None or dev.kind == "missing" or (dev.kind == "cuda" and card_profile(dev) is None):
                out.append(dev.name if dev is not None else dev_id)
        return out

    def prediction(self) -> pl.SpeedPrediction | None:
        """Predicted tokens/s of the plan on these devices; None without a plan or when a card in it
        has no known speed (unpriced_cards). Costs ~0.6 ms for a 64-layer model over two cards, so it
        runs on the GUI thread at every edit."""
        if self.plan is None or self.unpriced_cards():
            return None
        return pl.predict_speed(self.plan, self.device_specs())

    @property
    def has_experts(self) -> bool:
        """The model has routed experts (an MoE model) that can sit apart from their layers."""
        return self.plan is not None and any(p.experts for p in self.plan.costs.parts)

    def host_device(self) -> str:
        """The CPU's device name, where "host RAM" experts go."""
        return next((d.id for d in self.devices if d.kind == "cpu"), "cpu:0")

    def set_experts_in_host(self, on: bool) -> bool:
        """Every MoE layer's routed experts on the CPU (on) or with their layers (off), as one edit."""
        if self.plan is None or not self.has_experts:
            return False
        dev = self.host_device() if on else ""
        text = "put the routed experts in host RAM" if on else "put the routed experts back with their layers"

        def change(plan: pl.Placement) -> None:
            plan.experts_device = dev

        return self._edit(text, change)

    def set_experts_apart(self, part_indices: list[int], on_host: bool) -> bool:
        """The routed experts of the selected MoE layers in host RAM (on_host) or back with their
        layers, as one edit; other layers keep theirs where they are."""
        if self.plan is None:
            return False
        names = [self.plan.costs.parts[i].name for i in part_indices if self.plan.costs.parts[i].experts]
        if not names:
            return False
        host = self.host_device()

        def change(plan: pl.Placement) -> None:
            for n in names:
                if on_host:
                    plan.experts[n] = host
                else:
                    plan.experts.pop(n, None)

        where = "in host RAM" if on_host else "back with their layers"
        return self._edit(f"put the routed experts of {len(names)} layer(s) {where}", change)

    # ---- editing: each edit is one undoable step -----------------------------------------------------
    def _edit(self, text: str, change) -> bool:
        """Apply `change(plan)` to a copy of the plan as one undo step; False when it changed nothing."""
        if self.plan is None:
            return False
        before, after = self.plan.copy(), self.plan.copy()
        change(after)  # a refused edit raises PlacementError before anything is shown or recorded
        if after == before:
            return False
        self.undo_stack.push(_PlanEdit(self, before, after, text))
        return True

    def move_items(self, codes: list[int], device: str) -> bool:
        """Move dragged or keyed children to `device`: the parts (move_parts) and the routed experts'
        blocks (move_experts)."""
        experts, parts = [], []
        for c in codes:
            e = self.expert_part(c)
            if e is None:
                parts.append(c)
            else:
                experts.append(e)
        moved = self.move_experts(experts, device) if experts else False
        return (self.move_parts(parts, device) if parts else False) or moved

    def experts_can_go(self, part_indices: list[int], device: str) -> bool:
        """Whether these layers' routed experts may sit on `device`: host RAM (the CPU) or their own
        layer's device (the engine runs experts apart from their layer only from host RAM)."""
        if self.plan is None or not part_indices:
            return False
        return self._is_cpu(device) or all(self.plan.assignment[i] == device for i in part_indices)

    def move_experts(self, part_indices: list[int], device: str) -> bool:
        """The routed experts of these MoE layers to host RAM (device: the CPU) or back with their
        layers (device: the layers' own), as one edit; False when nothing changed or the device can
        hold neither (experts_can_go)."""
        if self.plan is None:
            return False
        moe = sorted({i for i in part_indices if self.plan.costs.parts[i].experts})
        if not moe or not self.experts_can_go(moe, device):
            return False
        return self.set_experts_apart(moe, self._is_cpu(device))

    def move_parts(self, part_indices: list[int], device: str) -> bool:
        """Move parts to `device`. With keep_contiguous, the parts between them and the device's nearest
        block come along, so the drop moves the boundary instead of scattering layers."""
        if self.plan is None or not part_indices:
            return False
        sel = sorted(set(int(i) for i in part_indices))
        if all(self.plan.assignment[i] == device for i in sel):
            return False
        self.set_excluded(device, False)  # layers put on a card by hand: it is in use again
        targets = [i for i, d in enumerate(self.plan.assignment) if d == device]
        indices = sel
        if self.keep_contiguous and targets:
            lo, hi = sel[0], sel[-1]
            if hi < targets[0]:
                indices = list(range(lo, targets[0]))
            elif lo > targets[-1]:
                indices = list(range(targets[-1] + 1, hi + 1))

        def change(plan):
            for i in indices:
                plan.move_part(i, device)

        return self._edit(f"moved {self.plan.describe(indices)} to {device}", change)

    def move_boundary(self, boundary: int, first_part: int) -> None:
        self._edit("moved a boundary", lambda plan: plan.move_boundary(boundary, first_part))

    def auto_split(self, context: int | None = None, kv_type: str | None = None) -> None:
        if self.plan is None:
            return
        # on the calling thread: tests and scripts; the window uses auto_split_later
        auto = auto_split_plan(self.plan.costs, self.auto_specs(), context=context or self.plan.context,
                               chunk=self.plan.chunk, kv_type=kv_type or self.plan.kv_type,
                               n_sequences=self.plan.n_sequences, experts=dict(self.plan.experts))
        self._edit("auto-split the layers", lambda plan: _become(plan, auto))

    @property
    def auto_splitting(self) -> bool:
        return self._auto_base is not None

    def auto_split_later(self, context: int | None = None, kv_type: str | None = None) -> None:
        """auto_split on a worker thread: with card profiles the split is a speed-aware search
        (plan_candidates), 60+ ms for a 64-layer model over three cards. Its result becomes one undo
        step when it arrives, unless the plan was edited meanwhile (then it is dropped)."""
        if self.plan is None:
            return
        base = self.plan.copy()
        specs = self.auto_specs()
        settings = dict(context=context or base.context, chunk=base.chunk, kv_type=kv_type or base.kv_type,
                        n_sequences=base.n_sequences, experts=dict(base.experts))
        self._auto_seq += 1
        seq = self._auto_seq
        self._auto_base = base
        job = Job(lambda _progress, _cancel: (seq, auto_split_plan(base.costs, specs, **settings)),
                  error_types=(pl.PlacementError,))
        job.finished_ok.connect(self._auto_split_ready)
        job.failed.connect(self._auto_split_error)
        job.finished.connect(lambda: _forget(job))
        _RUNNING_JOBS.add(job)
        job.start()
        self.auto_split_running.emit(True)

    def _auto_split_ready(self, result) -> None:
        seq, auto = result
        if seq != self._auto_seq:
            return
        base, self._auto_base = self._auto_base, None
        if self.plan is not None and self.plan == base:
            self._edit("auto-split the layers", lambda plan: _become(plan, auto))
        self.auto_split_running.emit(False)

    def _auto_split_error(self, message: str) -> None:
        self._auto_base = None
        self.auto_split_running.emit(False)
        self.auto_split_failed.emit(message)

    def set_settings(self, **settings) -> None:
        if self.plan is None:
            return
        changed = self.plan.with_settings(**settings)
        self._edit("changed the context or KV cache type", lambda plan: _become(plan, changed))

    # ---- QAbstractItemModel -------------------------------------------------------------------------
    def index(self, row, column=0, parent=QModelIndex()):
        if column != 0 or row < 0:
            return QModelIndex()
        if not parent.isValid():
            return self.createIndex(row, 0, 0) if row < len(self.devices) else QModelIndex()
        if parent.internalId() != 0:
            return QModelIndex()
        drow = parent.row()
        if drow >= len(self._children) or row >= len(self._children[drow]):
            return QModelIndex()
        return self.createIndex(row, 0, drow + 1)

    def parent(self, index=QModelIndex()):
        if not index.isValid() or index.internalId() == 0:
            return QModelIndex()
        return self.createIndex(int(index.internalId()) - 1, 0, 0)

    def rowCount(self, parent=QModelIndex()):
        if not parent.isValid():
            return len(self.devices)
        if parent.internalId() != 0:
            return 0
        return len(self._children[parent.row()]) if parent.row() < len(self._children) else 0

    def columnCount(self, parent=QModelIndex()):
        return 1

    def part_of(self, index) -> int | None:
        if not index.isValid() or index.internalId() == 0:
            return None
        return self._children[int(index.internalId()) - 1][index.row()]

    def device_row_of(self, index) -> int | None:
        if not index.isValid():
            return None
        return index.row() if index.internalId() == 0 else int(index.internalId()) - 1

    def part_label(self, i: int) -> str:
        cost = self.plan.costs.parts[i]
        if cost.kind == "embedding":
            return "EMB"
        if cost.kind == "head":
            return "HEAD"
        label = cost.name.split(".", 1)[1]
        if cost.experts and self.plan.experts_of(i) != self.plan.assignment[i]:
            label += "+X"  # its routed experts sit elsewhere (host RAM)
        return label

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        part = self.part_of(index)
        if part is None:
            dev = self.devices[index.row()]
            if role == Qt.ItemDataRole.DisplayRole:
                return dev.name
            if role == DEVICE_ID_ROLE:
                return dev.id
            if role == BYTES_ROLE:
                b = self.bytes_per_device().get(dev.id)
                return b.total if b else 0
            return None
        layer = self.expert_part(part)
        if layer is not None:
            return self._experts_data(layer, part, role)
        cost = self.plan.costs.parts[part]
        if role == Qt.ItemDataRole.DisplayRole:
            return self.part_label(part)
        if role == Qt.ItemDataRole.ToolTipRole:
            kv = cost.kv_bytes(self.plan.context, self.plan.kv_type)
            lines = [f"<b>{cost.name}</b> — {KIND_NAMES.get(cost.kind, cost.kind)}",
                     f"weights {format_bytes(cost.weight_bytes)}"]
            if kv:
                lines.append(f"KV cache {format_bytes(kv)} at {self.plan.context} tokens ({self.plan.kv_type})")
            if cost.state_bytes:
                lines.append(f"recurrent state {format_bytes(cost.state_bytes)}")
            if cost.experts:
                dev = self.plan.experts_of(part)
                where = "with the layer" if dev == self.plan.assignment[part] else f"on {dev}"
                if dev.startswith("cpu:"):
                    where = self.host_experts_where(part)
                lines.append(f"routed experts {format_bytes(cost.expert_bytes)}, {where} · drag its X block or right-click to move them")
            lines.append(f"on {self.plan.assignment[part]} · drag to another device, or Alt+↑/↓")
            return "<br>".join(lines)
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"{cost.name} ({cost.kind}) on {self.plan.assignment[part]}"
        if role == KIND_ROLE:
            return cost.kind
        if role == PART_INDEX_ROLE:
            return part
        if role == DEVICE_ID_ROLE:
            return self.plan.assignment[part]
        if role == BYTES_ROLE:
            return cost.weight_bytes
        return None

    def host_experts_where(self, layer: int) -> str:
        """Where part `layer`'s host-RAM experts run, as the runtime decides it: on the CPU in decode;
        in prefill, streamed to the layer's GPU when this plan's runs reach the GPU's threshold over its
        link (placement.expert_stream_min_tokens, the rule `minecart plan` states), else on the CPU."""
        edev, ldev = self.plan.experts_of(layer), self.plan.assignment[layer]
        specs = self.device_specs()
        n = pl.expert_stream_min_tokens(self.plan, ldev, specs) if not self._is_cpu(ldev) else None
        if n is None:
            return f"in host RAM ({edev}), where their layer runs"
        link = pl.link_of(next((d for d in specs if d.name == ldev), None)).name
        run = self.plan.chunk
        how = f"streamed to {ldev}" if run >= n else "kept on the CPU"
        return (f"in host RAM ({edev}): the CPU runs them in decode; this plan's {run:,}-token prefill runs "
                f"are {how} (over {link} streaming wins from {n:,} tokens)")

    def _experts_data(self, layer: int, code: int, role):
        """data() of the routed experts' block of part `layer` (child code `code`)."""
        cost = self.plan.costs.parts[layer]
        dev = self.plan.experts_of(layer)
        if role == Qt.ItemDataRole.DisplayRole:
            return "X" + cost.name.split(".", 1)[1]
        if role == Qt.ItemDataRole.ToolTipRole:
            where = self.host_experts_where(layer) if dev.startswith("cpu:") else f"with their layer on {dev}"
            return (f"<b>{cost.name}</b> — its routed experts, {format_bytes(cost.expert_bytes)}, {where}"
                    f"<br>drag to the CPU for host RAM, or back to the layer's device")
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"routed experts of {cost.name} on {dev}"
        if role == KIND_ROLE:
            return "experts"
        if role == PART_INDEX_ROLE:
            return code
        if role == DEVICE_ID_ROLE:
            return dev
        if role == BYTES_ROLE:
            return cost.expert_bytes
        return None

    def flags(self, index):
        if not index.isValid():
            return Qt.ItemFlag.ItemIsDropEnabled
        if index.internalId() == 0:
            return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsDropEnabled
        return (Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsDragEnabled)

    def supportedDropActions(self):
        return Qt.DropAction.MoveAction

    def supportedDragActions(self):
        return Qt.DropAction.MoveAction

    def mimeTypes(self):
        return [MIME_PARTS]

    def mimeData(self, indexes):
        parts = sorted({p for p in (self.part_of(i) for i in indexes) if p is not None})
        md = QMimeData()
        md.setData(MIME_PARTS, QByteArray(json.dumps(parts).encode()))
        return md

    @staticmethod
    def parts_from_mime(data) -> list[int]:
        if data is None or not data.hasFormat(MIME_PARTS):
            return []
        try:
            return [int(x) for x in json.loads(bytes(data.data(MIME_PARTS)).decode())]
        except (ValueError, TypeError):
            return []

    def canDropMimeData(self, data, action, row, column, parent):
        codes = self.parts_from_mime(data)
        drow = self.device_row_of(parent)
        if not codes or drow is None:
            return False
        experts = [e for e in (self.expert_part(c) for c in codes) if e is not None]
        # experts' blocks alone go only where experts can sit: host RAM or their own layer's device
        return len(experts) < len(codes) or self.experts_can_go(experts, self.devices[drow].id)

    def dropMimeData(self, data, action, row, column, parent):
        codes = self.parts_from_mime(data)
        drow = self.device_row_of(parent)
        if not codes or drow is None or action == Qt.DropAction.IgnoreAction:
            return False
        self.move_items(codes, self.devices[drow].id)
        # False: the move already happened here; the view must not also remove the source rows.
        return False


def _become(plan: pl.Placement, other: pl.Placement) -> None:
    """Make `plan` equal to `other` in place (an undo step edits a copy of the plan)."""
    plan.assignment[:] = other.assignment
    for name in ("context", "chunk", "kv_type", "n_sequences", "cuda_context_bytes"):
        setattr(plan, name, getattr(other, name))
    plan.experts = dict(other.experts)


class _PlanEdit(QUndoCommand):
    """One edit of the plan: the plans before and after it."""

    def __init__(self, model: LayerMapModel, before: pl.Placement, after: pl.Placement, text: str):
        super().__init__(text)
        self.model, self.before, self.after = model, before, after

    def redo(self) -> None:
        self.model._show(self.after)

    def undo(self) -> None:
        self.model._show(self.before)


class BlockDelegate(QStyledItemDelegate):
    """Paints one part as a rounded block: colour by kind, a glyph that tells GDN from attention."""

    SIZE = QSize(46, 42)

    def sizeHint(self, option, index):
        return self.SIZE

    def paint(self, painter: QPainter, option, index):
        kind = index.data(KIND_ROLE) or "gdn"
        label = index.data(Qt.ItemDataRole.DisplayRole) or ""
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        focused = bool(option.state & QStyle.StateFlag.State_HasFocus)
        r = QRectF(option.rect).adjusted(3, 3, -3, -3)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        base = QColor(theme.KIND_COLORS.get(kind, "#6b7a99"))
        fill = QColor(base)
        fill.setAlpha(235 if selected else 170)
        path = QPainterPath()
        path.addRoundedRect(r, 6, 6)
        painter.fillPath(path, fill)
        if selected or focused:
            painter.setPen(QPen(QColor("#ffffff"), 2))
            painter.drawPath(path)
        # glyphs: GDN = a recurrence wave, attention = a dotted grid (KV cache), sliding = a short grid
        painter.setPen(QPen(QColor(15, 17, 21, 170), 1.4))
        gy = r.bottom() - 8
        if kind == "gdn":
            wave = QPainterPath()
            x0 = r.left() + 8
            wave.moveTo(x0, gy)
            step = (r.width() - 16) / 4
            for k in range(4):
                wave.quadTo(x0 + step * (k + 0.5), gy - 4 if k % 2 == 0 else gy + 4, x0 + step * (k + 1), gy)
            painter.drawPath(wave)
        elif kind in ("attention", "sliding"):
            cols = 5 if kind == "attention" else 3
            painter.setBrush(QColor(15, 17, 21, 170))
            for c in range(cols):
                for rr in range(2):
                    painter.drawEllipse(QRectF(r.left() + 8 + c * 6, gy - 4 + rr * 5, 2.6, 2.6))
        else:
            painter.drawLine(int(r.left() + 9), int(gy), int(r.right() - 9), int(gy))
        f = QFont(option.font)
        f.setBold(True)
        f.setPointSizeF(8.5 if len(label) > 3 else 9.5)
        painter.setFont(f)
        painter.setPen(QColor("#101216"))
        painter.drawText(r.adjusted(0, 2, 0, -10), Qt.AlignmentFlag.AlignCenter, label)
        painter.restore()


class MemoryBar(QWidget):
    """Stacked bar: weights + KV cache + state + scratch/overhead against the device's free memory."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.segments: list[tuple[str, int]] = []
        self.capacity = 0
        self.setMinimumHeight(12)
        self.setMaximumHeight(12)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_usage(self, bytes_: pl.DeviceBytes | None, capacity: int) -> None:
        self.capacity = max(int(capacity), 0)
        if bytes_ is None:
            self.segments = []
        else:
            self.segments = [("weights", bytes_.weights), ("kv", bytes_.kv_cache), ("state", bytes_.recurrent),
                             ("scratch", bytes_.activations), ("overhead", bytes_.overhead),
                             ("pinned", bytes_.pinned)]
        self.update()

    @property
    def used(self) -> int:
        return sum(v for _, v in self.segments)

    @property
    def overflow(self) -> bool:
        return self.capacity > 0 and self.used > self.capacity

    def paintEvent(self, _):
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        bg = QPainterPath()
        bg.addRoundedRect(r, 5, 5)
        p.fillPath(bg, QColor("#232833"))
        scale = max(self.capacity, self.used, 1)
        x = r.left()
        p.setClipPath(bg)
        for name, v in self.segments:
            w = r.width() * v / scale
            if w <= 0:
                continue
            p.fillRect(QRectF(x, r.top(), w, r.height()), QColor(theme.MEM_COLORS[name]))
            x += w
        p.setClipping(False)
        if self.overflow:
            cap_x = r.left() + r.width() * self.capacity / scale
            p.setPen(QPen(QColor(theme.DANGER), 2))
            p.drawLine(int(cap_x), int(r.top()) - 1, int(cap_x), int(r.bottom()) + 1)
            p.setPen(QPen(QColor(theme.DANGER), 1.2))
            p.drawPath(bg)
        p.end()


class LaneView(QListView):
    """One device's blocks: icon mode, wrapping, drag and drop, keyboard moves (Alt+Up/Down)."""

    move_requested = Signal(list, int)  # part indices, direction (-1 previous device, +1 next)
    menu_requested = Signal(list, QPoint)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setViewMode(QListView.ViewMode.IconMode)
        self.setFlow(QListView.Flow.LeftToRight)
        self.setWrapping(True)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setMovement(QListView.Movement.Static)
        self.setSpacing(1)
        self.setUniformItemSizes(True)
        self.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.setDragEnabled(True)
        self.setAcceptDrops(True)
        self.viewport().setAcceptDrops(True)  # drops land on the viewport; it must accept them itself
        self.setDropIndicatorShown(True)
        self.setDragDropMode(QAbstractItemView.DragDropMode.DragDrop)
        self.setDefaultDropAction(Qt.DropAction.MoveAction)
        self.setItemDelegate(BlockDelegate(self))
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setMinimumHeight(52)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(
            lambda pos: self.menu_requested.emit(self.selected_parts(), self.viewport().mapToGlobal(pos)))
        self.setStyleSheet("QListView { background: #15181e; border: 1px dashed #2c313c; border-radius: 8px; }")

    def selected_parts(self) -> list[int]:
        return sorted(int(i.data(PART_INDEX_ROLE)) for i in self.selectedIndexes()
                      if i.data(PART_INDEX_ROLE) is not None)

    def keyPressEvent(self, event):
        alt = event.modifiers() & Qt.KeyboardModifier.AltModifier
        if alt and event.key() in (Qt.Key.Key_Up, Qt.Key.Key_Down):
            parts = self.selected_parts()
            if not parts and self.currentIndex().isValid():
                parts = [int(self.currentIndex().data(PART_INDEX_ROLE))]
            if parts:
                self.move_requested.emit(parts, -1 if event.key() == Qt.Key.Key_Up else 1)
            event.accept()
            return
        super().keyPressEvent(event)

    def fit_height(self) -> None:
        """Grow to show every block (lanes scroll together in the panel, not one by one)."""
        n = self.model().rowCount(self.rootIndex()) if self.model() else 0
        per_row = max(1, (self.viewport().width() - 4) // BlockDelegate.SIZE.width())
        rows = max(1, -(-n // per_row))
        self.setFixedHeight(rows * (BlockDelegate.SIZE.height() + 2) + 10)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self.fit_height()


class DeviceLane(QFrame):
    """A device card: name and specs, the memory bar with numbers, and its blocks."""

    def __init__(self, model: LayerMapModel, row: int, parent=None):
        super().__init__(parent)
        self.model = model
        self.row = row
        self.setObjectName("Card")
        dev = model.devices[row]
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        lay.setSpacing(8)
        head = QHBoxLayout()
        ic = QLabel()
        ic.setPixmap(theme.icon_pixmap("gpu" if dev.kind == "cuda" else "cpu", theme.MUTED, 20))
        head.addWidget(ic)
        title = QLabel(f"<b>{dev.name}</b>")
        head.addWidget(title)
        sub_bits = [dev.id]
        if dev.sm:
            sub_bits.append(dev.sm)
        if dev.total_bytes > 0:
            sub_bits.append(f"{format_bytes(dev.total_bytes)} {'VRAM' if dev.kind == 'cuda' else 'RAM'}")
        if dev.source == "simulated":
            sub_bits.append("simulated")
        sub = QLabel(" · ".join(sub_bits))
        sub.setObjectName("Subtle")
        head.addWidget(sub)
        self.use: QCheckBox | None = None  # GPUs only: whether automatic plans may use this card
        if dev.kind == "cuda":
            self.use = QCheckBox("Use")
            self.use.setChecked(dev.id not in model.excluded)
            self.use.setToolTip("Untick to leave this card out: its layers move to the other devices, and "
                                "Auto-split and new models' plans do not use it (dragging layers here "
                                "takes it back in)")
            self.use.toggled.connect(lambda on, d=dev.id: model.set_excluded(d, not on))
            model.exclusion_changed.connect(self._sync_use)
            head.addWidget(self.use)
        self.numbers = QLabel()
        self.numbers.setObjectName("Subtle")
        self.numbers.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        # long numbers must not widen the window: the label shrinks (and clips) instead
        self.numbers.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        head.addWidget(self.numbers, 1)
        lay.addLayout(head)
        self.bar = MemoryBar()
        lay.addWidget(self.bar)
        self.warning = QLabel()
        self.warning.setObjectName("ErrorText")
        self.warning.setWordWrap(True)
        self.warning.hide()
        lay.addWidget(self.warning)
        self.view = LaneView()
        self.view.setModel(model)
        self.view.setRootIndex(model.index(row, 0))
        lay.addWidget(self.view)
        model.modelReset.connect(self._reroot)

    def _sync_use(self) -> None:
        if self.use is None or self.row >= len(self.model.devices):
            return
        used = self.model.devices[self.row].id not in self.model.excluded
        if self.use.isChecked() != used:
            self.use.blockSignals(True)
            self.use.setChecked(used)
            self.use.blockSignals(False)

    def _reroot(self) -> None:
        if self.row < self.model.rowCount():
            self.view.setRootIndex(self.model.index(self.row, 0))
            self.view.fit_height()

    def refresh(self, per: dict, issues: list) -> None:
        dev = self.model.devices[self.row]
        b = per.get(dev.id)
        cap = device_spec(dev).free_bytes if dev.kind != "missing" else 0
        self.bar.set_usage(b, cap)
        need = b.total if b else 0
        if b:
            parts = [f"weights {format_bytes(b.weights)}"]
            plan = self.model.plan
            held = sum(1 for d in plan.experts_apart().values() if d == dev.id)
            if held:  # the lane may hold no block at all: say what its weights are
                parts[0] += f" (incl. the routed experts of {held} layers)"
            if b.kv_cache:
                parts.append(f"KV {format_bytes(b.kv_cache)} ({self.model.plan.kv_type})")
            if b.recurrent:
                parts.append(f"state {format_bytes(b.recurrent)}")
            scratch = f"scratch {format_bytes(b.activations)}"
            if b.expert_staging:  # host-RAM experts stream through two buffers on this card
                scratch += f" (incl. expert staging {format_bytes(b.expert_staging)})"
            parts.append(scratch)
            if b.overhead:
                parts.append(f"CUDA ctx {format_bytes(b.overhead)}")
            if b.pinned:  # the experts once more, page-locked, for the GPUs' prefill to stream from
                parts.append(f"pinned copy of the experts {format_bytes(b.pinned)}")
            self.numbers.setText(f"<span style='color:#e4e7ee'><b>{format_bytes(need)}</b></span> of "
                                 f"{format_bytes(cap)} free  ·  " + "  ·  ".join(parts))
            # a narrow window clips the line: the tooltip keeps every number
            self.numbers.setToolTip(f"{format_bytes(need)} of {format_bytes(cap)} free: " + ", ".join(parts))
        elif dev.id in self.model.excluded:
            self.numbers.setText(f"left out  ·  {format_bytes(cap)} free — tick Use to plan with this card")
            self.numbers.setToolTip("Auto-split and new models' plans do not use this card")
        elif dev.source == "simulated":
            self.numbers.setText(f"empty  ·  {format_bytes(cap)} free — a simulated card: for planning only")
            self.numbers.setToolTip("MINECART_SIMULATE_DEVICES cards exist only on paper; a plan that uses "
                                    "them loads with their layers on the CPU")
        else:
            self.numbers.setText(f"empty  ·  {format_bytes(cap)} free — drop layers here")
            self.numbers.setToolTip("")
        errs = [i.message for i in issues if i.device == dev.id and i.severity == "error"]
        self.warning.setText("⚠ " + errs[0] if errs else "")
        self.warning.setVisible(bool(errs))


class LayerMapPanel(QWidget):
    """The page: toolbar (context, KV type, contiguous, Auto-split, Apply), legend, lanes, issues."""

    apply_requested = Signal(object)  # Placement

    def __init__(self, model: LayerMapModel, parent=None):
        super().__init__(parent)
        self.model = model
        self.lanes: list[DeviceLane] = []
        self.prediction: pl.SpeedPrediction | None = None  # of the plan on screen
        outer = QVBoxLayout(self)
        outer.setContentsMargins(24, 18, 24, 18)
        outer.setSpacing(12)

        head = QHBoxLayout()
        t = QLabel("Layer map")
        t.setObjectName("PageTitle")
        head.addWidget(t)
        head.addSpacing(18)
        # the plan's predicted speed, recomputed at every edit (LayerMapModel.prediction); beside the
        # title, on a row of its own it pushed the window past its minimum height. It gives up width
        # (clipped, the tooltip keeps the words) rather than widening the window.
        self.speed = QLabel()
        self.speed.setObjectName("Prediction")
        self.speed.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        head.addWidget(self.speed, 1)
        # the controls get a row of their own: beside the title they made the page 1,058 px wide
        top = QHBoxLayout()
        self.subtitle = QLabel("Select a model to plan where its layers run.")
        self.subtitle.setObjectName("Subtle")
        self.subtitle.setWordWrap(True)
        self.subtitle.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        top.addWidget(self._small("Context"))
        self.context = QSpinBox()
        self.context.setRange(256, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setValue(4096)
        self.context.setSuffix(" tok")
        self.context.setToolTip("Context length the KV cache is sized for")
        top.addWidget(self.context)
        top.addWidget(self._small("KV"))
        self.kv_type = QComboBox()
        for i, name in enumerate(KV_TYPES):
            self.kv_type.addItem(name)
            self.kv_type.setItemData(i, KV_TYPE_TIPS.get(name, name), Qt.ItemDataRole.ToolTipRole)
        self.kv_type.setCurrentText(DEFAULT_KV_TYPE)
        self.kv_type.setToolTip("KV cache type of the attention layers; a change takes effect on Apply "
                                "(the model loads again)\n" + "\n".join(KV_TYPE_TIPS.get(n, n) for n in KV_TYPES))
        top.addWidget(self.kv_type)
        self.contiguous = QCheckBox("Keep contiguous")
        self.contiguous.setChecked(True)
        self.contiguous.setToolTip("Dropping a layer on a device moves the boundary: the layers between come along")
        top.addWidget(self.contiguous)
        # shown for MoE models only: the way to fit one whose experts outweigh the cards
        self.experts_host = QCheckBox("Experts in host RAM")
        self.experts_host.setToolTip("Put every MoE layer's routed experts in the computer's RAM (the CPU "
                                     "runs them); the cards keep attention and the shared parts, so they "
                                     "need far less memory, at some cost in speed. Takes effect on Load "
                                     "(a loaded model loads again)")
        self.experts_host.hide()
        self.auto_btn = QPushButton(theme.icon("auto"), " Auto-split")
        self.auto_btn.setToolTip("Use as few devices as hold the model (GPUs in order, the CPU last), "
                                 "split by free memory")
        top.addWidget(self.auto_btn)
        self.apply_btn = QPushButton(theme.icon("check", "#1a1307"), " Apply")
        self.apply_btn.setObjectName("Primary")
        self.apply_btn.setToolTip("Re-place the loaded model with this plan (and remember it for this model)")
        top.addWidget(self.apply_btn)
        top.addStretch(1)
        outer.addLayout(head)
        outer.addLayout(top)
        # the model's line, with the MoE control beside it (the toolbar row had no room left at 960 px)
        about = QHBoxLayout()
        about.addWidget(self.subtitle, 1)
        about.addWidget(self.experts_host)
        outer.addLayout(about)
        # why the map shows what it shows: a fallback or a failed load (MainWindow's load state)
        self.notice = QLabel()
        self.notice.setObjectName("WarnText")
        self.notice.setWordWrap(True)
        self.notice.hide()
        outer.addWidget(self.notice)

        # two legend rows (one was 900 px wide): the kinds of block, then the parts of a memory bar.
        # Only the kinds the model has are listed (a Qwen3.5 has no sliding-window layers).
        kinds = QHBoxLayout()
        kinds.setSpacing(14)
        self.kind_swatches = {}
        for kind, text in (("embedding", "Embedding / LM head"), ("gdn", "Gated DeltaNet"),
                           ("attention", "Full attention"), ("sliding", "Sliding window"),
                           ("experts", "Routed experts (X: drag to the CPU for host RAM)")):
            self.kind_swatches[kind] = self._swatch(theme.KIND_COLORS[kind], text)
            kinds.addWidget(self.kind_swatches[kind])
        kinds.addStretch(1)
        outer.addLayout(kinds)
        legend = QHBoxLayout()
        legend.setSpacing(14)
        for key, text in (("weights", "weights"), ("kv", "KV cache"), ("state", "state"), ("scratch", "scratch"),
                          ("overhead", "CUDA context"), ("pinned", "pinned copy (host experts)")):
            legend.addWidget(self._swatch(theme.MEM_COLORS[key], text, bar=True))
        legend.addStretch(1)
        outer.addLayout(legend)

        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setMinimumHeight(110)  # a lane's head and a row of blocks, however small the window
        self.lane_host = QWidget()
        self.lane_layout = QVBoxLayout(self.lane_host)
        self.lane_layout.setContentsMargins(0, 0, 4, 0)
        self.lane_layout.setSpacing(10)
        self.scroll.setWidget(self.lane_host)
        outer.addWidget(self.scroll, 1)

        self.hint_text = ("Drag blocks onto another device (the first/last block moves the boundary) · "
                          "Alt+↑/↓ moves the selection · Ctrl+Z undoes · right-click for a menu")
        self.hint = QLabel(self.hint_text)
        self.hint.setObjectName("Subtle")
        self.hint.setWordWrap(True)
        outer.addWidget(self.hint)
        # what the last edit did (a keyboard move with "Keep contiguous" can take many layers along)
        model.undo_stack.undoTextChanged.connect(self._show_last_edit)
        self.issues = QLabel()
        self.issues.setWordWrap(True)
        self.issues.setObjectName("WarnText")
        self.issues.hide()
        outer.addWidget(self.issues)

        self.context.editingFinished.connect(self._settings_changed)
        self.kv_type.currentTextChanged.connect(self._settings_changed)
        self.contiguous.toggled.connect(lambda on: setattr(self.model, "keep_contiguous", on))
        self.experts_host.toggled.connect(self.model.set_experts_in_host)
        # Ctrl+Z / Ctrl+Shift+Z on this page only (the chat's text boxes keep their own undo)
        self.undo_action = model.undo_stack.createUndoAction(self, "Undo")
        self.redo_action = model.undo_stack.createRedoAction(self, "Redo")
        for act, keys in ((self.undo_action, QKeySequence.StandardKey.Undo),
                          (self.redo_action, QKeySequence.StandardKey.Redo)):
            act.setShortcut(keys)
            act.setShortcutContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
            self.addAction(act)
        self.auto_btn.clicked.connect(self._auto)
        model.auto_split_running.connect(self._auto_running)
        model.auto_split_failed.connect(lambda msg: self.hint.setText(f"Auto-split failed: {msg}"))
        self.apply_btn.clicked.connect(self._apply)
        model.plan_changed.connect(self.refresh)
        model.exclusion_changed.connect(self.refresh)
        model.modelReset.connect(self._maybe_rebuild_lanes)
        self._rebuild_lanes()
        self.refresh()

    @staticmethod
    def _small(text: str) -> QLabel:
        lab = QLabel(text)
        lab.setObjectName("Subtle")
        return lab

    @staticmethod
    def _swatch(color: str, text: str, bar: bool = False) -> QWidget:
        w = QWidget()
        h = QHBoxLayout(w)
        h.setContentsMargins(0, 0, 0, 0)
        h.setSpacing(6)
        sw = QLabel()
        sw.setFixedSize(QSize(14, 8) if bar else QSize(12, 12))
        sw.setStyleSheet(f"background:{color}; border-radius:{2 if bar else 3}px;")
        h.addWidget(sw)
        lab = QLabel(text)
        lab.setObjectName("Subtle")
        h.addWidget(lab)
        return w

    def _show_last_edit(self, done: str) -> None:
        # the text comes with the signal: the stack itself may be on its way out (the model closing)
        self.hint.setText(f"Last edit: {done} · Ctrl+Z undoes it" if done else self.hint_text)

    def set_notice(self, text: str, error: bool = False) -> None:
        self.notice.setText(("Loading failed: " if error else "") + text if text else "")
        self.notice.setObjectName("ErrorText" if error else "WarnText")
        self.notice.style().unpolish(self.notice)
        self.notice.style().polish(self.notice)
        self.notice.setVisible(bool(text))

    def _maybe_rebuild_lanes(self) -> None:
        if len(self.lanes) != self.model.rowCount():
            self._rebuild_lanes()

    def _rebuild_lanes(self) -> None:
        for lane in self.lanes:
            lane.setParent(None)
            lane.deleteLater()
        self.lanes = []
        while self.lane_layout.count():
            self.lane_layout.takeAt(0)
        for row in range(self.model.rowCount()):
            lane = DeviceLane(self.model, row)
            lane.view.move_requested.connect(lambda parts, d, r=row: self._move_dir(parts, r, d))
            lane.view.menu_requested.connect(self._menu)
            self.lanes.append(lane)
            self.lane_layout.addWidget(lane)
        self.lane_layout.addStretch(1)

    def _move_dir(self, parts: list[int], row: int, direction: int) -> None:
        target = row + direction
        if 0 <= target < self.model.rowCount():
            self.model.move_items(parts, self.model.devices[target].id)
            lane = self.lanes[target]
            lane.view.setFocus()

    def _menu(self, parts: list[int], pos: QPoint) -> None:
        if not parts:
            return
        menu = QMenu(self)
        for dev in self.model.devices:
            act = QAction(f"Move to {dev.name} ({dev.id})", menu)
            act.triggered.connect(lambda _=False, d=dev.id: self.model.move_items(parts, d))
            menu.addAction(act)
        layers = sorted({self.model.layer_of(c) for c in parts})
        moe = [i for i in layers if self.model.plan is not None and self.model.plan.costs.parts[i].experts]
        if moe:
            menu.addSeparator()
            plan = self.model.plan
            apart = [i for i in moe if plan.experts_of(i) != plan.assignment[i]]
            to_host = QAction(f"Routed experts of {len(moe)} layer(s) to host RAM", menu)
            to_host.triggered.connect(lambda _=False: self.model.set_experts_apart(moe, True))
            to_host.setEnabled(len(apart) < len(moe))
            back = QAction(f"Routed experts of {len(moe)} layer(s) back with the layer", menu)
            back.triggered.connect(lambda _=False: self.model.set_experts_apart(moe, False))
            back.setEnabled(bool(apart))
            menu.addAction(to_host)
            menu.addAction(back)
        menu.addSeparator()
        menu.addAction(self.undo_action)
        menu.addAction(self.redo_action)
        menu.exec(pos)

    def _settings_changed(self) -> None:
        if self.model.plan is None:
            return
        ctx, kv = int(self.context.value()), self.kv_type.currentText()
        if ctx != self.model.plan.context or kv != self.model.plan.kv_type:
            self.model.set_settings(context=ctx, kv_type=kv)

    def _auto(self) -> None:
        self.model.auto_split_later(int(self.context.value()), self.kv_type.currentText())

    def _auto_running(self, running: bool) -> None:
        self.auto_btn.setText(" Planning…" if running else " Auto-split")
        self.auto_btn.setEnabled(not running and self.model.plan is not None)

    def _apply(self) -> None:
        if self.model.plan is not None:
            self.apply_requested.emit(self.model.plan.copy())

    def refresh(self) -> None:
        plan = self.model.plan
        per = self.model.bytes_per_device()
        issues = self.model.issues()
        for lane in self.lanes:
            lane.refresh(per, issues)
        has_plan = plan is not None
        present = {"embedding"} | (set(plan.costs.layer_kinds) if has_plan else set(KIND_NAMES))
        if self.model.has_experts:
            present.add("experts")
        for kind, swatch in self.kind_swatches.items():
            swatch.setVisible(kind in present)
        self.apply_btn.setEnabled(has_plan and not any(i.severity == "error" for i in issues))
        self.auto_btn.setEnabled(has_plan and not self.model.auto_splitting)
        if has_plan:
            self.context.blockSignals(True)
            self.context.setValue(plan.context)
            self.context.blockSignals(False)
            self.kv_type.blockSignals(True)
            self.kv_type.setCurrentText(plan.kv_type)
            self.kv_type.blockSignals(False)
            c = plan.costs
            n_gdn = sum(1 for k in c.layer_kinds if k == "gdn")
            n_att = len(c.layer_kinds) - n_gdn
            self.subtitle.setText(f"{c.name} · {c.n_layers} layers ({n_gdn} GDN, {n_att} attention) · "
                                  f"weights {format_bytes(c.weight_bytes)} · {plan.crossings()} device crossing"
                                  f"{'' if plan.crossings() == 1 else 's'} per token")
        self.experts_host.setVisible(self.model.has_experts)
        self.experts_host.blockSignals(True)  # shows the plan; a click, not this, edits it
        moe = [p.name for p in plan.costs.parts if p.experts] if has_plan else []
        # checked when every MoE layer's experts are in host RAM (the block menu moves single layers)
        self.experts_host.setChecked(bool(moe) and all(plan.experts.get(n, "").startswith("cpu:") for n in moe))
        self.experts_host.blockSignals(False)
        self._show_speed()
        if issues:
            self.issues.setText("\n".join(("⛔ " if i.severity == "error" else "⚠ ") + i.message for i in issues))
            self.issues.setObjectName("ErrorText" if issues[0].severity == "error" else "WarnText")
            self.issues.style().unpolish(self.issues)
            self.issues.style().polish(self.issues)
        self.issues.setVisible(bool(issues))
        self.apply_btn.setToolTip("Fix the errors below first" if any(i.severity == "error" for i in issues)
                                  else "Re-place the loaded model with this plan (and remember it for this model)")


    def _show_speed(self) -> None:
        plan = self.model.plan
        unpriced = self.model.unpriced_cards()
        pred = self.model.prediction()
        self.prediction = pred
        if plan is None:
            self.speed.setText("")
            self.speed.setToolTip("")
        elif pred is None:
            self.speed.setText(f"Predicted: speed unknown for {', '.join(unpriced)} (not in the card profiles)")
            self.speed.setToolTip(f"Speed unknown for {', '.join(unpriced)}: resources/gpu_profiles.json "
                                  "lists the common mining and gaming cards; a card it does not list is not "
                                  "guessed at")
        else:
            self.speed.setText(f"Predicted: decode ~{format_rate(pred.decode_tokens_per_s)} tok/s · "
                               f"prefill ~{format_rate(pred.prefill_tokens_per_s)} tok/s "
                               f"({pred.prompt:,}-token prompt)")
            specs = {s.name: s for s in self.model.device_specs()}
            where = [f"{d}: {specs[d].speed.source if d in specs and specs[d].speed else pl.CPU_SPEED.name}"
                     for d in plan.devices_holding()]
            self.speed.setToolTip(self.speed.text() + "\nFrom each card's memory bandwidth, int8/fp32 rate "
                                  "and link (engine predict_speed):\n" + "\n".join(where))


def costs_for_file(path) -> pl.ModelCosts:
    """Per-part costs of a GGUF file (reads its header and tensor table)."""
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile

    gf = GGUFFile(path)
    return pl.model_costs(ModelConfig.from_gguf(gf), gf)


def initial_plan(costs: pl.ModelCosts, devices: list[DeviceInfo], saved: dict | None = None,
                 context: int = 4096) -> tuple[pl.Placement, str]:
    """The remembered plan for this model if it still fits the file, else an automatic one.
    Returns (plan, note) where note explains a discarded saved plan."""
    note = ""
    if saved:
        try:
            plan = pl.Placement.from_dict(saved, costs)
            if plan.kv_type not in KV_TYPES:
                return runnable_plan(plan), (f"restored your saved plan (with an {DEFAULT_KV_TYPE} KV cache: "
                                             f"its {plan.kv_type} is not run by the engine)")
            return plan, "restored your saved plan"
        except Exception as exc:
            note = f"saved plan ignored: {exc}"
    return auto_split_plan(costs, [device_spec(d) for d in devices], context=context,
                           kv_type=DEFAULT_KV_TYPE), note


def auto_split_plan(costs: pl.ModelCosts, specs: list[pl.DeviceSpec],
                    experts: dict[str, str] | None = None, **settings) -> pl.Placement:
    """The plan Auto-split makes, and a model's first plan. When every GPU's speed is known (a card
    profile or the probe), the fastest plan that fits, then the one with the longest context (engine
    plan_candidates: every device order and leading subset, each riser's crossings priced; a split
    does not make one stream faster, so a plan over fewer devices wins unless more are faster): a 9B
    goes on the 16 GiB HBM2 card, not the 8 GiB one listed first. Otherwise, or when no candidate fits,
    as few devices as hold the model: the first GPU, then the first two, ..., then all GPUs and the CPU
    last. If nothing fits, everything is used and the plan's warnings say by how much it overflows.
    experts: where MoE layers' routed experts stay when apart ("layer.N" -> "cpu:0" = host RAM; absent =
    with their layers); the layers are split around them. Without such a map, an MoE model that has GPUs
    and host RAM to use also gets the experts-in-host-RAM plan (`minecart plan --experts-on auto`: the
    layers on the GPUs, the experts that do not fit there in host RAM), and whichever of the two is
    predicted to decode faster wins (a 35B-A3B Q4_K on a P104-100: 56.0 tokens/s predicted against 5.7
    with 25 of its 40 layers on the CPU, `minecart plan` with and without --experts-on auto)."""
    plan = _layer_split_plan(costs, specs, experts, **settings)
    return plan if experts else pl.faster_with_experts_apart(plan, costs, specs, **settings)


def _layer_split_plan(costs: pl.ModelCosts, specs: list[pl.DeviceSpec], experts: dict[str, str] | None,
                      **settings) -> pl.Placement:
    """auto_split_plan's split of the layers, the routed experts where `experts` says."""
    gpus = [s for s in specs if s.is_cuda]
    order = gpus + [s for s in specs if not s.is_cuda]
    if not order:
        raise pl.PlacementError("no devices to place the model on")
    if gpus and all(s.speed is not None for s in gpus):
        fastest = next((c.plan for c in pl.plan_candidates(costs, order, experts=experts, **settings)
                        if not _errors(c.plan, order)), None)
        if fastest is not None:
            return fastest
    plan = None
    for k in range(1, len(order) + 1):
        if experts:
            # plan_candidates knows experts apart; the fit is checked on every device, the experts' too
            tried = [c.plan for c in pl.plan_candidates(costs, order[:k], experts=experts, **settings)]
            plan = next((p for p in tried if not _errors(p, specs)), tried[0])
        else:
            plan = pl.plan_auto(costs, None, order[:k], **settings)
        if not _errors(plan, specs if experts else order[:k]):
            return plan
    return plan


def _errors(plan: pl.Placement, specs: list[pl.DeviceSpec]) -> bool:
    return any(i.severity == "error" for i in pl.validate(plan, specs))


__all__ = ["DEFAULT_KV_TYPE", "LayerMapModel", "LayerMapPanel", "costs_for_file", "auto_split_plan",
           "initial_plan", "runnable_kv_type", "runnable_plan", "MIME_PARTS"]
