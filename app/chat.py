"""The chat page: conversations list, the message column, the composer, and the generation settings.

Streaming tokens arrive from the EngineBridge as signals (batched there every 25 ms); the reply's widget is
marked dirty and a 30 Hz QTimer re-renders dirty messages. A message body is a MarkdownView
(markdown_view.py) that re-renders only the blocks that changed, so a 15k-token reply costs the same per
update as a short one.
The model's thinking goes into a collapsible block above the answer. Stop, regenerate, edit-and-resend,
copy, thinking on/off, a system prompt and sampling settings are here; conversations are saved as JSON
(conversations.py). Images can be dropped or pasted; they show as thumbnails and go into the request as
{"type": "image", "path": ...} content parts when the model has a vision tower; without one the chat says
so and sends the text alone.
The context meter beside Send shows how much of the loaded model's context limit the chat holds
("1,234 / 8,192 tokens" and a thin bar), from the counts the bridge sends with each batch of tokens and
at the end of each turn. A turn beyond the limit gets a note with two actions: start a new chat, or
raise the limit (the window re-places the model with a longer context and asks again).
"""

from __future__ import annotations

import html
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QImage, QKeySequence, QPixmap, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import theme
from .conversations import Conversation, ConversationStore
from .markdown_view import MarkdownView
from .settings import data_dir

if TYPE_CHECKING:
    from .engine_bridge import EngineBridge, TurnEnd

CURSOR = "<span style='color:#f0a43a'> ▍</span>"  # after the text while a reply streams
ELLIPSIS = "<span style='color:#8d96a8'>…</span>"  # a reply with no text yet
UNDO_DELETE_MS = 15_000
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}
BASE_MODEL_TEXT = ("{name} is a pretrained base model (its file has no chat template): it continues text "
                   "rather than following instructions. \u201cContinue text\u201d is on, so your message is "
                   "sent as the start of a text for it to carry on; load an instruction-tuned model for "
                   "real chat.")
FULL_SHARE = 0.9  # the context meter turns red from this share of the limit on
CONTEXT_FULL_TEXT = ("This chat needs {needed:,} tokens, but the loaded model holds at most {limit:,} "
                     "(its context limit: the prompt, the whole conversation and the answer together). "
                     "Start a new chat, or raise the limit: the model is re-placed with a longer context "
                     "if one fits the memory of your devices, and this message is sent again.")
NO_VISION_TEXT = ("This model has no vision tower, so it cannot see images. The picture stays in the chat, "
                  "but only your text is sent. Load a model with a vision projector (mmproj) to ask about images.")


def _flat_button(icon_name: str, tip: str) -> QToolButton:
    b = QToolButton()
    b.setObjectName("Flat")
    b.setIcon(theme.icon(icon_name, theme.MUTED))
    b.setIconSize(QSize(16, 16))
    b.setToolTip(tip)
    b.setCursor(Qt.CursorShape.PointingHandCursor)
    return b


def thumbnail(path: str, size: int = 120) -> QPixmap | None:
    img = QImage(str(path))
    if img.isNull():
        return None
    return QPixmap.fromImage(img.scaled(size, size, Qt.AspectRatioMode.KeepAspectRatio,
                                        Qt.TransformationMode.SmoothTransformation))


def _position(messages: list[dict], message: dict) -> int | None:
    """Index of this very message dict (not an equal one: "continue" twice is two messages)."""
    return next((i for i, m in enumerate(messages) if m is message), None)


class ThinkingBlock(QFrame):
    """Collapsible 'Thinking' block; open while the model thinks, folded once the answer starts."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("ThinkingBox")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 8)
        lay.setSpacing(4)
        self.toggle = QToolButton()
        self.toggle.setObjectName("Flat")
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setCheckable(True)
        self.toggle.setChecked(True)
        self.toggle.setStyleSheet("color:#9aa3b5; font-weight:600;")
        lay.addWidget(self.toggle)
        self.body = MarkdownView("ThinkingText")
        lay.addWidget(self.body)
        self.toggle.toggled.connect(self._toggled)
        self._toggled(True)

    def _toggled(self, open_: bool) -> None:
        self.body.setVisible(open_)
        self.toggle.setIcon(theme.icon("chevron-down" if open_ else "chevron-right", "#9aa3b5"))

    def set_text(self, text: str, done: bool) -> None:
        if done:
            self.toggle.setText(f"Thought · {len(text.split())} words")
        else:
            self.toggle.setText("Thinking…")
        self.body.set_markdown(text, streaming=not done)

    @property
    def expanded(self) -> bool:
        return self.toggle.isChecked()


class MessageWidget(QFrame):
    """One message: role, optional thinking, Markdown body, thumbnails, actions, stats."""

    copy_requested = Signal(object)
    edit_requested = Signal(object)
    regenerate_requested = Signal(object)

    def __init__(self, message: dict, parent=None):
        super().__init__(parent)
        self.message = message
        role = message.get("role", "assistant")
        self.setObjectName({"user": "UserBubble", "assistant": "AssistantBubble", "notice": "NoticeBubble",
                            "error": "ErrorBubble"}.get(role, "AssistantBubble"))
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 10)
        lay.setSpacing(6)
        head = QHBoxLayout()
        head.setSpacing(6)
        names = {"user": "You", "assistant": "Assistant", "notice": "Note", "error": "Engine error"}
        self.role_label = QLabel(names.get(role, role).upper())
        self.role_label.setObjectName("RoleLabel")
        if role in ("notice", "error"):
            ic = QLabel()
            ic.setPixmap(theme.icon_pixmap("warning", theme.WARN if role == "notice" else theme.DANGER, 14))
            head.addWidget(ic)
        head.addWidget(self.role_label)
        head.addStretch(1)
        self.copy_btn = _flat_button("copy", "Copy this message")
        self.edit_btn = _flat_button("edit", "Edit and resend")
        self.regen_btn = _flat_button("regenerate", "Regenerate this reply")
        for b in (self.copy_btn, self.edit_btn, self.regen_btn):
            head.addWidget(b)
        self.edit_btn.setVisible(role == "user")
        self.regen_btn.setVisible(role == "assistant")
        self.copy_btn.setVisible(role in ("user", "assistant"))
        lay.addLayout(head)
        self.thinking = ThinkingBlock()
        self.thinking.hide()
        lay.addWidget(self.thinking)
        self.images_row = QHBoxLayout()
        self.images_row.setSpacing(6)
        for p in message.get("images") or []:
            lab = QLabel()
            lab.setObjectName("Thumb")
            px = thumbnail(p)
            if px is not None:
                lab.setPixmap(px)
            else:
                lab.setText(Path(p).name)
            lab.setToolTip(str(p))
            self.images_row.addWidget(lab)
        self.images_row.addStretch(1)
        if message.get("images"):
            lay.addLayout(self.images_row)
        # block by block: a streaming reply re-renders only its changed tail (markdown_view.py)
        self.body = MarkdownView("MessageText")
        lay.addWidget(self.body)
        self.stats = QLabel()
        self.stats.setObjectName("StatsLabel")
        self.stats.hide()
        lay.addWidget(self.stats)
        self.copy_btn.clicked.connect(lambda: self.copy_requested.emit(self))
        self.edit_btn.clicked.connect(lambda: self.edit_requested.emit(self))
        self.regen_btn.clicked.connect(lambda: self.regenerate_requested.emit(self))
        self.actions: list[QPushButton] = []  # buttons under the text (add_action), e.g. a note's way out
        self._actions_row: QHBoxLayout | None = None
        self.streaming = False
        self.render()

    def add_action(self, text: str, slot, primary: bool = False) -> QPushButton:
        """A button under the message's text that calls `slot()` (a note's ways out)."""
        if self._actions_row is None:
            self._actions_row = QHBoxLayout()
            self._actions_row.setSpacing(8)
            self._actions_row.addStretch(1)
            lay = self.layout()
            assert isinstance(lay, QVBoxLayout)
            lay.insertLayout(lay.indexOf(self.stats), self._actions_row)
        b = QPushButton(text)
        if primary:
            b.setObjectName("Primary")
        b.clicked.connect(lambda _=False: slot())
        self._actions_row.insertWidget(self._actions_row.count() - 1, b)
        self.actions.append(b)
        return b

    def render(self) -> None:
        m = self.message
        thinking = m.get("thinking") or ""
        content = m.get("content") or ""
        if thinking:
            self.thinking.show()
            done = bool(content) or not self.streaming
            self.thinking.set_text(thinking, done)
            if content and self.streaming and self.thinking.expanded and not m.get("_folded"):
                self.thinking.toggle.setChecked(False)  # fold once the answer starts
                m["_folded"] = True
        if m.get("role") == "user":
            self.body.set_html(html.escape(content).replace("\n", "<br>"))
        elif content:
            self.body.set_markdown(content, streaming=self.streaming, suffix=CURSOR if self.streaming else "")
        else:
            self.body.set_html(ELLIPSIS if self.streaming else "")
        self.body.setVisible(bool(content) or self.streaming and not thinking)
        st = m.get("stats")
        if st:
            self.stats.setText(st)
            self.stats.show()


class ContextMeter(QFrame):
    """How much of the loaded model's context limit the open chat holds: "1,234 / 8,192 tokens" and
    a thin bar. Hidden while no model is loaded. Setting it is cheap (a label and a bar), so it can
    follow a streaming reply batch by batch."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("ContextMeter")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        self.label = QLabel()
        self.label.setObjectName("StatsLabel")
        self.label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.label.setMinimumWidth(40)  # a narrow window gets the short text (resizeEvent)
        lay.addWidget(self.label)
        self.bar = QProgressBar()
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(4)
        self.bar.setMinimumWidth(40)
        lay.addWidget(self.bar)
        self.used: int | None = None
        self.limit = 0
        self.text = ""  # "1,234 / 8,192 tokens"; the label shows it, or without " tokens" when narrow
        self.hide()

    def set_usage(self, used: int | None, limit: int) -> None:
        """used: tokens the chat holds (None: not known until its next turn); limit: the model's
        context limit (0: no model, the meter hides)."""
        self.used, self.limit = used, max(0, int(limit))
        if not self.limit:
            self.hide()
            return
        shown = "–" if used is None else f"{used:,}"
        self.text = f"{shown} / {self.limit:,} tokens"
        self._fit_text()
        self.bar.setRange(0, self.limit)
        self.bar.setValue(0 if used is None else min(int(used), self.limit))
        level = "full" if used is not None and used >= FULL_SHARE * self.limit else "ok"
        if self.bar.property("level") != level:  # the style sheet colours the bar by level
            self.bar.setProperty("level", level)
            self.bar.style().unpolish(self.bar)
            self.bar.style().polish(self.bar)
        if used is None:
            tip = "How much of the context this chat uses is measured at its next turn."
        else:
            tip = (f"This chat holds {used:,} of the {self.limit:,} tokens the loaded model's context "
                   f"holds ({100 * min(used, self.limit) / self.limit:.0f}%): the whole conversation "
                   "and the answer together. Past it, start a new chat or load the model with a "
                   "longer context.")
        self.setToolTip(tip)
        self.show()

    def sizeHint(self) -> QSize:
        return QSize(max(120, self.label.fontMetrics().horizontalAdvance(self.text) + 4),
                     super().sizeHint().height())

    def _fit_text(self) -> None:
        fits = self.label.fontMetrics().horizontalAdvance(self.text) <= self.label.width()
        self.label.setText(self.text if fits else self.text.removesuffix(" tokens"))

    def resizeEvent(self, e) -> None:
        super().resizeEvent(e)
        self._fit_text()


class Composer(QPlainTextEdit):
    """Message input: Enter sends, Shift+Enter is a newline; pasted images become attachments."""

    send = Signal()
    escape = Signal()
    image_pasted = Signal(str)

    def keyPressEvent(self, e):
        if e.key() == Qt.Key.Key_Escape:
            self.escape.emit()  # stop a running generation
            return
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (e.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.send.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, source):
        return source.hasImage() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source):
        if source.hasUrls():
            paths = [u.toLocalFile() for u in source.urls() if Path(u.toLocalFile()).suffix.lower() in IMAGE_SUFFIXES]
            if paths:
                for p in paths:
                    self.image_pasted.emit(p)
                return
        if source.hasImage():
            img = source.imageData()
            if isinstance(img, QImage) and not img.isNull():
                folder = data_dir() / "images"
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"pasted-{uuid.uuid4().hex[:10]}.png"
                img.save(str(path), "PNG")
                self.image_pasted.emit(str(path))
                return
        super().insertFromMimeData(source)


class SettingsPanel(QFrame):
    """System prompt, thinking, sampling. Values live in the app Settings dict."""

    changed = Signal()

    def __init__(self, settings, parent=None):
        super().__init__(parent)
        self.settings = settings
        self.setObjectName("Card")
        self.setFixedWidth(270)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        lay.setSpacing(8)
        t = QLabel("GENERATION")
        t.setObjectName("SectionTitle")
        lay.addWidget(t)
        lay.addWidget(self._label("System prompt"))
        self.system = QPlainTextEdit(settings.get("system_prompt", ""))
        self.system.setFixedHeight(96)
        self.system.setPlaceholderText("Instructions for the assistant…")
        lay.addWidget(self.system)
        self.thinking = QCheckBox("Thinking (reasoning before the answer)")
        self.thinking.setChecked(bool(settings.get("thinking", False)))
        lay.addWidget(self.thinking)
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.setHorizontalSpacing(10)
        form.setVerticalSpacing(6)
        s = settings.get("sampling", {})
        self.temperature = self._dspin(0, 2, 0.05, s.get("temperature", 0.7))
        self.top_p = self._dspin(0.01, 1, 0.01, s.get("top_p", 0.9))
        self.top_k = self._ispin(0, 1000, s.get("top_k", 40))
        self.min_p = self._dspin(0, 1, 0.01, s.get("min_p", 0.05))
        self.repeat = self._dspin(0.5, 2, 0.01, s.get("repeat_penalty", 1.05))
        self.max_tokens = self._ispin(1, 1 << 17, s.get("max_tokens", 1024))
        self.seed = self._ispin(-1, 2**31 - 1, s.get("seed", -1))
        self.seed.setSpecialValueText("random")
        for name, w in (("Temperature", self.temperature), ("Top-p", self.top_p), ("Top-k", self.top_k),
                        ("Min-p", self.min_p), ("Repeat penalty", self.repeat), ("Max tokens", self.max_tokens),
                        ("Seed", self.seed)):
            form.addRow(self._label(name), w)
        lay.addLayout(form)
        lay.addStretch(1)
        for w in (self.temperature, self.top_p, self.min_p, self.repeat):
            w.valueChanged.connect(self._store)
        for w in (self.top_k, self.max_tokens, self.seed):
            w.valueChanged.connect(self._store)
        self.thinking.toggled.connect(self._store)
        self.system.textChanged.connect(self._store)

    @staticmethod
    def _label(text):
        lab = QLabel(text)
        lab.setObjectName("Subtle")
        return lab

    @staticmethod
    def _dspin(lo, hi, step, value):
        w = QDoubleSpinBox()
        w.setRange(lo, hi)
        w.setSingleStep(step)
        w.setDecimals(2)
        w.setValue(min(max(float(value), lo), hi))  # a saved value outside the range is clamped
        return w

    @staticmethod
    def _ispin(lo, hi, value):
        w = QSpinBox()
        w.setRange(lo, hi)
        w.setValue(min(max(int(value), lo), hi))  # Qt overflows on ints beyond 32 bits
        return w

    def sampling(self) -> dict:
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(), "top_k": self.top_k.value(),
                "min_p": self.min_p.value(), "repeat_penalty": self.repeat.value(),
                "max_tokens": self.max_tokens.value(), "seed": self.seed.value()}

    def _store(self, *_):
        self.settings["sampling"] = self.sampling()
        self.settings["thinking"] = self.thinking.isChecked()
        self.settings["system_prompt"] = self.system.toPlainText()
        self.changed.emit()


class ChatPanel(QWidget):
    """Conversations, messages, composer. Talks to the engine only through the EngineBridge."""

    # "Raise the limit" under a context-full note: the tokens the turn needed (the window re-places
    # the model with a longer context and calls retry_turn once it is back)
    raise_context_requested = Signal(int)

    def __init__(self, bridge: EngineBridge, settings, store: ConversationStore | None = None,
                 parent=None):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        self.store = store or ConversationStore()
        self.conv = Conversation(system_prompt=settings.get("system_prompt", ""))
        self.widgets: list[MessageWidget] = []
        self.pending_images: list[str] = []
        self.current: MessageWidget | None = None
        self.model_loaded = False
        self.model_has_vision = False
        self.model_path = ""
        self.model_name = ""
        self.loading_name = ""  # the model a load is bringing in ('' when no load is running)
        self._dirty: set[MessageWidget] = set()
        self._context_used: dict[str, int] = {}  # conversation id -> tokens its last turn held
        self.context_notice: MessageWidget | None = None  # the newest context-full note, if on screen
        app = QApplication.instance()
        if app is not None:  # quitting mid-reply keeps what has streamed so far
            app.aboutToQuit.connect(self.save)
        self._turn_started = 0.0
        self.setAcceptDrops(True)

        root = QHBoxLayout(self)
        root.setContentsMargins(0, 0, 0, 0)
        root.setSpacing(0)

        # conversations
        side = QFrame()
        side.setStyleSheet("QFrame { background: #171a20; border-right: 1px solid #22262f; }")
        side.setFixedWidth(230)
        sl = QVBoxLayout(side)
        sl.setContentsMargins(10, 14, 10, 10)
        sl.setSpacing(8)
        self.new_btn = QPushButton(theme.icon("plus"), " New chat")
        sl.addWidget(self.new_btn)
        lab = QLabel("CONVERSATIONS")
        lab.setObjectName("SectionTitle")
        lab.setStyleSheet("border: none; padding-left: 4px; color:#8d96a8; font-size:8.5pt;")
        sl.addWidget(lab)
        self.conv_list = QListWidget()
        self.conv_list.setObjectName("ConversationList")
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conv_list.setStyleSheet("QListView { border: none; }")
        self.conv_list.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        sl.addWidget(self.conv_list, 1)
        self.delete_btn = QPushButton(theme.icon("trash", theme.MUTED), " Delete chat")
        sl.addWidget(self.delete_btn)
        # a deleted chat can be brought back for UNDO_DELETE_MS (no confirmation dialog to click through)
        self.undo_bar = QFrame()
        self.undo_bar.setObjectName("UndoBar")
        ub = QHBoxLayout(self.undo_bar)
        ub.setContentsMargins(8, 4, 4, 4)
        self.undo_label = QLabel()
        self.undo_label.setObjectName("Subtle")
        self.undo_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        ub.addWidget(self.undo_label, 1)
        self.undo_btn = QPushButton("Undo")
        ub.addWidget(self.undo_btn)
        self.undo_bar.hide()
        sl.addWidget(self.undo_bar)
        self._deleted: Conversation | None = None
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.setInterval(UNDO_DELETE_MS)
        self._undo_timer.timeout.connect(self._forget_deleted)
        root.addWidget(side)

        # messages + composer
        center = QVBoxLayout()
        center.setContentsMargins(0, 0, 0, 0)
        center.setSpacing(0)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        host = QWidget()
        host.setObjectName("ChatColumn")
        hl = QHBoxLayout(host)
        hl.setContentsMargins(24, 18, 24, 18)
        hl.addStretch(1)
        col = QWidget()
        col.setObjectName("ChatColumn")
        col.setMaximumWidth(860)
        col.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.column = QVBoxLayout(col)
        self.column.setContentsMargins(0, 0, 0, 0)
        self.column.setSpacing(12)
        self.empty = QLabel()
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setWordWrap(True)
        self.empty.setObjectName("Subtle")
        self.column.addStretch(1)
        self.column.addWidget(self.empty)
        self.column.addStretch(2)
        self._empty_stretch = True
        hl.addWidget(col, 100)
        hl.addStretch(1)
        self.scroll.setWidget(host)
        center.addWidget(self.scroll, 1)

        comp_wrap = QWidget()
        cw = QHBoxLayout(comp_wrap)
        cw.setContentsMargins(24, 6, 24, 16)
        cw.addStretch(1)
        box = QFrame()
        box.setObjectName("Composer")
        box.setMaximumWidth(860)
        box.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        bl = QVBoxLayout(box)
        bl.setContentsMargins(10, 8, 10, 8)
        bl.setSpacing(6)
        self.attach_notice = QLabel(NO_VISION_TEXT)
        self.attach_notice.setWordWrap(True)
        self.attach_notice.setObjectName("WarnText")
        self.attach_notice.hide()
        bl.addWidget(self.attach_notice)
        self.base_notice = QLabel("")
        self.base_notice.setWordWrap(True)
        self.base_notice.setObjectName("WarnText")
        self.base_notice.hide()
        bl.addWidget(self.base_notice)
        self.attach_row = QHBoxLayout()
        self.attach_row.setSpacing(6)
        self.attach_row.addStretch(1)
        bl.addLayout(self.attach_row)
        self.input = Composer()
        self.input.setPlaceholderText("Message the model…  (Enter to send, Shift+Enter for a new line; drop or paste images)")
        self.input.setFixedHeight(64)
        bl.addWidget(self.input)
        row = QHBoxLayout()
        self.image_btn = _flat_button("image", "Attach an image")
        row.addWidget(self.image_btn)
        self.think_btn = QToolButton()
        self.think_btn.setObjectName("Flat")
        self.think_btn.setCheckable(True)
        self.think_btn.setIcon(theme.icon("thinking", theme.MUTED, theme.ACCENT))
        self.think_btn.setText(" Thinking")
        self.think_btn.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.think_btn.setToolTip("Let the model reason before answering")
        row.addWidget(self.think_btn)
        # Base (pretrained) models do not follow instructions; they continue text. In this mode the
        # last message is sent as raw text, without the chat template, and the reply continues it.
        self.complete_btn = QToolButton()
        self.complete_btn.setObjectName("Flat")
        self.complete_btn.setCheckable(True)
        self.complete_btn.setIcon(theme.icon("edit", theme.MUTED, theme.ACCENT))
        self.complete_btn.setText(" Continue text")
        self.complete_btn.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.complete_btn.setToolTip("Send your message as raw text (no chat template) and let the model "
                                     "continue it: the way to use a pretrained base model")
        row.addWidget(self.complete_btn)
        self.settings_btn = QToolButton()
        self.settings_btn.setObjectName("Flat")
        self.settings_btn.setCheckable(True)
        self.settings_btn.setIcon(theme.icon("settings", theme.MUTED, theme.ACCENT))
        self.settings_btn.setToolTip("System prompt and sampling settings")
        row.addWidget(self.settings_btn)
        self.hint = QLabel()
        self.hint.setObjectName("StatsLabel")
        row.addWidget(self.hint)
        row.addStretch(1)
        self.context_meter = ContextMeter()
        row.addWidget(self.context_meter)
        self.send_btn = QPushButton(theme.icon("send", "#1a1307"), " Send")
        self.send_btn.setObjectName("Primary")
        row.addWidget(self.send_btn)
        self.stop_btn = QPushButton(theme.icon("stop", "#ffb3ad"), " Stop")
        self.stop_btn.setObjectName("Danger")
        self.stop_btn.hide()
        row.addWidget(self.stop_btn)
        bl.addLayout(row)
        cw.addWidget(box, 100)
        cw.addStretch(1)
        center.addWidget(comp_wrap)
        cwidget = QWidget()
        cwidget.setLayout(center)
        root.addWidget(cwidget, 1)

        self.settings_panel = SettingsPanel(settings)
        sp_wrap = QWidget()
        spl = QVBoxLayout(sp_wrap)
        spl.setContentsMargins(0, 14, 14, 14)
        spl.addWidget(self.settings_panel)
        self.settings_wrap = sp_wrap
        sp_wrap.hide()
        root.addWidget(sp_wrap)

        self.think_btn.setChecked(self.settings_panel.thinking.isChecked())
        self.think_btn.toggled.connect(self.settings_panel.thinking.setChecked)
        self.settings_panel.thinking.toggled.connect(self.think_btn.setChecked)
        self.settings_btn.toggled.connect(sp_wrap.setVisible)
        self.settings_panel.changed.connect(self._settings_changed)
        self.new_btn.clicked.connect(self.new_chat)
        self.delete_btn.clicked.connect(self.delete_chat)
        self.undo_btn.clicked.connect(self.undo_delete)
        self.conv_list.currentItemChanged.connect(self._open_selected)
        self.input.send.connect(self.send)
        self.input.image_pasted.connect(self.attach_image)
        self.send_btn.clicked.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.image_btn.clicked.connect(self._pick_image)

        bridge.token.connect(self._on_token)
        bridge.chat_done.connect(self._on_done)
        bridge.chat_cancelled.connect(self._on_cancelled)
        bridge.chat_error.connect(self._on_error)
        bridge.context_full.connect(self._on_context_full)
        bridge.context_used.connect(self._on_context_used)
        bridge.busy_changed.connect(lambda _busy: self._update_buttons())

        self.render_timer = QTimer(self)
        self.render_timer.setInterval(33)
        self.render_timer.timeout.connect(self._render_dirty)
        self.render_timer.start()
        self._scroll_timer = QTimer(self)
        self._scroll_timer.setSingleShot(True)
        self._scroll_timer.setInterval(0)
        self._scroll_timer.timeout.connect(
            lambda: self.scroll.verticalScrollBar().setValue(self.scroll.verticalScrollBar().maximum()))
        self._hint_timer = QTimer(self)
        self._hint_timer.setSingleShot(True)
        self._hint_timer.setInterval(1500)
        self._hint_timer.timeout.connect(self.hint.clear)
        self._settings_save = QTimer(self)
        self._settings_save.setSingleShot(True)
        self._settings_save.setInterval(800)
        self._settings_save.timeout.connect(self._save_settings)

        # Esc stops a generation: from the composer, and anywhere in the chat page
        self.input.escape.connect(self.stop)
        stop_key = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        stop_key.setContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
        stop_key.activated.connect(self.stop)

        self.refresh_conversations()
        self._update_empty()
        self._update_buttons()

    # ---- model state ---------------------------------------------------------------------------------
    def set_loading(self, name: str) -> None:
        """Say in the empty chat which model is loading ('' when no load is running)."""
        self.loading_name = name
        self._update_empty()

    def set_model(self, loaded: bool, name: str = "", has_vision: bool = False, path: str = "",
                  base_model: bool = False) -> None:
        info = self.bridge.model_info
        if loaded and not name and not path and info is not None:
            # "still loaded" without details (a failed or cancelled load left the model in place):
            # it is the bridge's current model, name, vision and all
            name, has_vision = info.name, info.has_vision
            path, base_model = str(info.path), info.base_model
        self.model_loaded = loaded
        self.base_notice.setText(BASE_MODEL_TEXT.format(name=name or "This model"))
        self.base_notice.setVisible(loaded and base_model)
        self.complete_btn.setChecked(loaded and base_model)
        self.loading_name = ""
        self.model_has_vision = has_vision
        self.model_path = path
        self.model_name = name
        self._update_meter()
        self._update_empty()
        self._update_buttons()
        self.attach_notice.setVisible(bool(self.pending_images) and not has_vision)

    def _update_empty(self) -> None:
        # the stretch above the empty-state text centres it; with messages, they start at the top
        self.column.setStretch(0, 0 if self.widgets else 1)
        if self.widgets:
            self.empty.hide()
            return
        self.empty.show()
        if self.model_loaded:
            self.empty.setText(f"<div style='font-size:15pt; color:#e4e7ee; font-weight:600'>{self.model_name}</div>"
                               "<div style='margin-top:6px'>Ask anything. Drop an image here, or press Enter to send.</div>")
        elif self.loading_name:
            self.empty.setText(f"<div style='font-size:15pt; color:#e4e7ee; font-weight:600'>Loading {self.loading_name}…</div>"
                               "<div style='margin-top:6px'>Progress is in the bar above; you can type while it loads.</div>")
        else:
            self.empty.setText("<div style='font-size:15pt; color:#e4e7ee; font-weight:600'>No model loaded</div>"
                               "<div style='margin-top:6px'>Pick one on the Models page, or wait for the default model to load.</div>")

    def _update_meter(self) -> None:
        limit = self.bridge.context_limit if self.model_loaded else 0
        self.context_meter.set_usage(self._context_used.get(self.conv.id) if self.conv.messages else 0,
                                     limit)

    def _on_context_used(self, used: int) -> None:
        if self.current is None:
            return  # a turn of a chat left since (its counts belong to no chat on screen)
        self._context_used[self.conv.id] = int(used)
        self.context_meter.set_usage(int(used), self.bridge.context_limit)

    def _update_buttons(self) -> None:
        busy = self.bridge.generating
        self.send_btn.setVisible(not busy)
        self.stop_btn.setVisible(busy)
        self.send_btn.setEnabled(self.model_loaded)
        self.input.setEnabled(True)

    # ---- conversations ---------------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        convs = self.store.list()
        ids = [c.id for c in convs]
        if self.conv.messages and self.conv.id not in ids:
            convs.insert(0, self.conv)
        for c in convs:
            it = QListWidgetItem(c.title)
            it.setData(Qt.ItemDataRole.UserRole, c.id)
            it.setToolTip(time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated)))
            self.conv_list.addItem(it)
            if c.id == self.conv.id:
                self.conv_list.setCurrentItem(it)
        self.conv_list.blockSignals(False)

    def new_chat(self) -> None:
        if self.bridge.generating:
            self.stop()
        self.save()  # the chat we leave keeps its last turn, a reply still streaming included
        self.conv = Conversation(system_prompt=self.settings.get("system_prompt", ""), model=self.model_path)
        self._rebuild_messages()
        self.refresh_conversations()
        self.input.setFocus()

    def delete_chat(self) -> None:
        """Delete the open chat; `undo_delete` brings it back for a while."""
        if self.bridge.generating:
            self.stop()
        conv = self.conv
        kept = Conversation.from_dict(conv.to_dict())
        self.store.delete(conv.id)
        conv.messages = []  # so that new_chat has nothing left to save back
        self.new_chat()
        if any(m.get("role") in ("user", "assistant") for m in kept.messages):
            self._deleted = kept
            self.undo_label.setText(f"Deleted “{kept.title}”")
            self.undo_label.setToolTip(kept.title)
            self.undo_bar.show()
            self._undo_timer.start()

    def undo_delete(self) -> None:
        kept, self._deleted = self._deleted, None
        self.undo_bar.hide()
        self._undo_timer.stop()
        if kept is None:
            return
        self.store.save(kept)
        self.refresh_conversations()
        self.open_conversation(kept.id)

    def _forget_deleted(self) -> None:
        self._deleted = None
        self.undo_bar.hide()

    def _open_selected(self, item, _prev=None) -> None:
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        if cid == self.conv.id:
            return
        try:
            conv = self.store.load(cid)
        except (OSError, ValueError) as exc:
            self._add_message({"role": "error", "content": f"could not open the conversation: {exc}"})
            return
        if self.bridge.generating:
            self.stop()
        self.save()  # the chat we leave keeps its last turn, a reply still streaming included
        self.conv = conv
        self._rebuild_messages()

    def open_conversation(self, conv_id: str) -> None:
        for i in range(self.conv_list.count()):
            if self.conv_list.item(i).data(Qt.ItemDataRole.UserRole) == conv_id:
                self.conv_list.setCurrentRow(i)
                return

    def save(self) -> None:
        if not any(m.get("role") in ("user", "assistant") for m in self.conv.messages):
            return
        self.conv.auto_title()
        self.conv.model = self.model_path or self.conv.model
        self.store.save(self.conv)
        self.refresh_conversations()

    def _rebuild_messages(self) -> None:
        for w in self.widgets:
            w.setParent(None)
            w.deleteLater()
        self.widgets = []
        self.current = None
        self._dirty.clear()  # a reply that was streaming had its widget deleted just above
        self.context_notice = None
        for m in self.conv.messages:
            self._add_widget(m)
        self._update_empty()
        self._update_meter()
        self._scroll_to_end()

    # ---- messages --------------------------------------------------------------------------------------
    def _add_widget(self, message: dict) -> MessageWidget:
        w = MessageWidget(message)
        w.copy_requested.connect(self._copy)
        w.edit_requested.connect(self._edit)
        w.regenerate_requested.connect(self._regenerate)
        self.column.insertWidget(self.column.count() - 1, w)
        self.widgets.append(w)
        self._update_empty()
        return w

    def _add_message(self, message: dict) -> MessageWidget:
        self.conv.messages.append(message)
        w = self._add_widget(message)
        self._scroll_to_end()
        return w

    def _scroll_to_end(self) -> None:
        self._scroll_timer.start()  # after the layout has grown to fit the new content

    def _near_bottom(self) -> bool:
        sb = self.scroll.verticalScrollBar()
        return sb.maximum() - sb.value() < 80

    def _copy(self, w: MessageWidget) -> None:
        QGuiApplication.clipboard().setText(w.message.get("content", ""))
        self.hint.setText("copied")
        self._hint_timer.start()

    def _edit(self, w: MessageWidget) -> None:
        """Put a user message back into the composer; sending replaces it and everything after it."""
        if self.bridge.generating:
            self.stop()
        idx = _position(self.conv.messages, w.message)
        if idx is None:
            return
        self.input.setPlainText(w.message.get("content", ""))
        self.pending_images = list(w.message.get("images") or [])
        self._refresh_attachments()
        self.conv.messages = self.conv.messages[:idx]
        self._rebuild_messages()
        self.input.setFocus()

    def _regenerate(self, w: MessageWidget | None = None) -> None:
        if self.bridge.generating or not self.model_loaded:
            return
        msgs = self.conv.messages
        idx = _position(msgs, w.message) if w is not None else None
        if idx is not None:
            del msgs[idx:]  # this reply and everything after it
        # drop notes and replies after the last user message, then ask again
        while msgs and msgs[-1].get("role") != "user":
            msgs.pop()
        if not msgs:
            return
        self._rebuild_messages()
        self._start_turn()

    def regenerate(self) -> None:
        self._regenerate(None)

    # ---- images ---------------------------------------------------------------------------------------
    def attach_image(self, path: str) -> None:
        if Path(path).suffix.lower() not in IMAGE_SUFFIXES or not Path(path).is_file():
            self._add_message({"role": "notice", "content": f"{Path(path).name} is not an image minecart can read "
                               f"({', '.join(sorted(IMAGE_SUFFIXES))})."})
            return
        self.pending_images.append(str(path))
        self._refresh_attachments()

    def _refresh_attachments(self) -> None:
        while self.attach_row.count() > 1:
            item = self.attach_row.takeAt(0)
            gone = item.widget()
            if gone is not None:
                # detach now: deleteLater alone leaves it painted until the event loop runs again
                gone.hide()
                gone.setParent(None)
                gone.deleteLater()
        for p in self.pending_images:
            lab = QLabel()
            lab.setObjectName("Thumb")
            px = thumbnail(p, 56)
            if px is not None:
                lab.setPixmap(px)
            lab.setToolTip(p)
            self.attach_row.insertWidget(self.attach_row.count() - 1, lab)
        self.attach_notice.setVisible(bool(self.pending_images) and not self.model_has_vision)

    def _pick_image(self) -> None:
        from PySide6.QtWidgets import QFileDialog

        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", str(Path.home()),
                                                "Images (" + " ".join(f"*{s}" for s in sorted(IMAGE_SUFFIXES)) + ")")
        for p in paths:
            self.attach_image(p)

    def dragEnterEvent(self, e):
        md = e.mimeData()
        if md.hasImage() or (md.hasUrls() and any(Path(u.toLocalFile()).suffix.lower() in IMAGE_SUFFIXES
                                                  for u in md.urls())):
            e.acceptProposedAction()

    def dropEvent(self, e):
        md = e.mimeData()
        if md.hasUrls():
            for u in md.urls():
                if Path(u.toLocalFile()).suffix.lower() in IMAGE_SUFFIXES:
                    self.attach_image(u.toLocalFile())
        elif md.hasImage():
            self.input.insertFromMimeData(md)
        e.acceptProposedAction()

    # ---- a turn ----------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if self.bridge.generating or (not text and not self.pending_images):
            return
        if not self.model_loaded:
            if self.loading_name:  # the message stays in the composer meanwhile
                text = f"{self.loading_name} is still loading; press Enter again once it is ready."
            else:
                text = "No model is loaded yet. Load one on the Models page."
            self._add_message({"role": "notice", "content": text})
            return
        images = list(self.pending_images)
        self.pending_images = []
        self._refresh_attachments()
        self.input.clear()
        self._add_message({"role": "user", "content": text, "images": images})
        self.save()  # on disk before the engine runs: a crash or a quit mid-reply keeps the question
        if images and not self.model_has_vision:
            self._add_message({"role": "notice", "content": NO_VISION_TEXT})
            if not text:
                self.save()
                return
        self._start_turn()

    def build_request(self) -> list[dict]:
        """The messages for the engine: system prompt, then user/assistant turns (notes left out)."""
        out = []
        system = self.settings_panel.system.toPlainText().strip()
        if system:
            out.append({"role": "system", "content": system})
        for m in self.conv.messages:
            role = m.get("role")
            if role not in ("user", "assistant"):
                continue
            if role == "assistant" and not m.get("content"):
                continue
            images = m.get("images") or []
            if role == "user" and images and self.model_has_vision:
                parts = [{"type": "image", "path": p} for p in images]
                if m.get("content"):
                    parts.append({"type": "text", "text": m["content"]})
                out.append({"role": "user", "content": parts})
            else:
                out.append({"role": role, "content": m.get("content", "")})
        return out

    def _start_turn(self) -> None:
        messages = self.build_request()
        reply = {"role": "assistant", "content": "", "thinking": ""}
        self.current = self._add_message(reply)
        self.current.streaming = True
        self.current.render()
        self._turn_started = time.time()
        if self.complete_btn.isChecked():
            prompt = next((m["content"] for m in reversed(messages)
                           if m.get("role") == "user" and isinstance(m.get("content"), str)), "")
            ok = self.bridge.complete(prompt, self.settings_panel.sampling(), conversation_id=self.conv.id)
        else:
            ok = self.bridge.chat(messages, self.settings_panel.sampling(),
                                  thinking=self.think_btn.isChecked(), conversation_id=self.conv.id)
        if not ok:
            return
        self._update_buttons()

    def stop(self) -> None:
        self.bridge.stop()

    def _on_token(self, answer: str, thinking: str) -> None:
        w = self.current
        if w is None:
            return
        if thinking:
            w.message["thinking"] = w.message.get("thinking", "") + thinking
        if answer:
            w.message["content"] = w.message.get("content", "") + answer
        self._dirty.add(w)

    def _render_dirty(self) -> None:
        if not self._dirty:
            return
        stick = self._near_bottom()
        for w in list(self._dirty):
            w.render()
        self._dirty.clear()
        if stick:
            self._scroll_to_end()

    def _finish(self, info: TurnEnd, note: str = "") -> None:
        w = self.current
        self.current = None
        if w is not None:
            w.streaming = False
            usage = info.get("usage")
            timing = info.get("timing")
            bits = []
            if usage is not None and usage.completion_tokens:
                bits.append(f"{usage.completion_tokens} tokens")
            if usage is not None and usage.image_tokens:
                bits.append(f"{usage.image_tokens} image tokens in the prompt")
            rate = ((timing.decode_tokens_per_s if timing is not None else None)
                    or (usage.decode_tokens_per_s if usage is not None else None))
            if rate:
                bits.append(f"{rate:.1f} tok/s")
            ttft = timing.time_to_first_token_s if timing is not None else None
            if ttft:
                bits.append(f"first token {ttft * 1000:.0f} ms")
            if info.get("finish_reason") == "length":
                bits.append("stopped at max tokens")
            if note:
                bits.append(note)
            w.message["stats"] = " · ".join(bits)
            w.message.pop("_folded", None)
            w.render()
        self._dirty.discard(w)
        self._update_buttons()
        self.save()

    def _on_done(self, info: TurnEnd) -> None:
        self._finish(info)

    def _on_cancelled(self, info: TurnEnd) -> None:
        self._finish(info, "stopped")

    def _on_context_full(self, needed: int, limit: int) -> None:
        """The turn did not fit the context limit (the engine refused it before computing anything):
        a note with the two ways out."""
        self._end_failed_turn()
        self._context_used[self.conv.id] = int(needed)
        self.context_meter.set_usage(int(needed), limit)
        w = self._add_message({"role": "notice", "content": CONTEXT_FULL_TEXT.format(needed=needed, limit=limit)})
        w.add_action("Start a new chat", self.new_chat)
        w.add_action("Raise the limit", lambda: self.raise_context_requested.emit(int(needed)), primary=True)
        self.context_notice = w
        self._update_buttons()
        self.save()

    def retry_turn(self) -> None:
        """Ask again for the chat's last user message (after the limit was raised)."""
        self._regenerate(None)

    def _on_error(self, text: str) -> None:
        self._end_failed_turn()
        self._add_message({"role": "error", "content": text})
        self._update_buttons()

    def _end_failed_turn(self) -> None:
        """The reply of a turn that failed: removed when nothing came, else finished as it is."""
        w = self.current
        if w is not None and not w.message.get("content") and not w.message.get("thinking"):
            idx = _position(self.conv.messages, w.message)
            if idx is not None:
                del self.conv.messages[idx]
            self.widgets.remove(w)
            self._dirty.discard(w)
            w.setParent(None)
            w.deleteLater()
            self.current = None
        else:
            self._finish({}, "error")
        self.current = None

    # ---- settings ----------------------------------------------------------------------------------------
    def _settings_changed(self) -> None:
        self._settings_save.start()

    def _save_settings(self) -> None:
        try:
            self.settings.save()
        except OSError:
            pass
