"""MarkdownView: Markdown shown as a column of rich-text labels, a few blocks each, updated incrementally.

A streaming reply grows at its end, so only its last block changes between two renders: the view keeps
each label's source and re-renders (and re-lays out) only the labels whose source changed. Rendering a
whole 15k-token reply into one label took ~460 ms; a block costs a few ms. While streaming, a block
longer than STREAM_PIECE_LINES is shown in pieces of that many lines (a code fence cut this way is
re-opened in the next piece), so even one huge code block only re-renders its last piece. When the
message ends, the view shows the plain blocks (a cut block is rendered whole once).

Not here: the Markdown rules (markdown.py) or the message's frame and buttons (chat.py).
"""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from .markdown import FENCE, split_blocks, to_html

STREAM_PIECE_LINES = 40
# Blocks are shown in labels of about this many characters: every label costs the layout a little on
# each update (Qt asks them all for their height), every character costs the label that re-renders.
GROUP_CHARS = 1000
# a block label's minimum width, and its hint's width before the layout has given it one
MIN_WIDTH, HINT_WIDTH = 120, 600


def stream_pieces(block: str, size: int = STREAM_PIECE_LINES) -> list[str]:
    """A block cut into pieces of `size` lines; a piece that starts inside a code fence begins with
    the fence's opening line again (to_html renders an unclosed fence as code so far)."""
    lines = block.split("\n")
    if len(lines) <= size:
        return [block]
    pieces = []
    opening = ""  # the open fence's first line, "" outside code
    for start in range(0, len(lines), size):
        chunk = lines[start:start + size]
        pieces.append("\n".join(([opening] if opening else []) + chunk))
        for line in chunk:
            if opening:
                if line.strip().startswith(FENCE.match(opening).group(1)):
                    opening = ""
            elif FENCE.match(line):
                opening = line
    return pieces


def group_blocks(blocks: list[str], chars: int = GROUP_CHARS) -> list[list[str]]:
    """Consecutive blocks gathered into groups of at least `chars` characters (the last may be
    shorter). Greedy from the start, so a text that grows at its end keeps its earlier groups."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for b in blocks:
        current.append(b)
        size += len(b)
        if size >= chars:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class _BlockLabel(QLabel):
    """A rich-text label that remembers its height for each width. Qt's layouts ask every label of a
    column for heightForWidth whenever one of them changes, and QLabel lays its text out afresh for
    each answer (~0.5 ms per block): without the cache a 15k-token reply cost 350 ms per update."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._heights: dict[int, int] = {}

    def setText(self, text: str) -> None:
        self._heights.clear()
        super().setText(text)

    def minimumSizeHint(self) -> QSize:
        """A fixed narrow minimum: QLabel's own lays a word-wrapped text out at width 0 (a word a
        line) to find its longest word, every time the text changes (~4 ms for one block)."""
        return QSize(MIN_WIDTH, 0)

    def sizeHint(self) -> QSize:
        """The height for the width the label has now, from the same cache as heightForWidth (QLabel's
        own hint lays the text out again at a width of its choosing; the column's width comes from
        the scroll area, not from this hint)."""
        width = self.width() if self.width() > MIN_WIDTH else HINT_WIDTH
        return QSize(width, self.heightForWidth(width))

    def heightForWidth(self, width: int) -> int:
        h = self._heights.get(width)
        if h is None:
            if len(self._heights) > 8:  # a window being resized asks for many widths
                self._heights.clear()
            h = self._heights[width] = super().heightForWidth(width)
        return h


class MarkdownView(QWidget):
    """Markdown (or one piece of ready HTML) as a column of labels; `set_markdown` updates only the
    blocks that changed."""

    def __init__(self, object_name: str = "MessageText", parent=None):
        super().__init__(parent)
        self._object_name = object_name
        self._lay = QVBoxLayout(self)
        self._lay.setContentsMargins(0, 0, 0, 0)
        self._lay.setSpacing(0)
        self._labels: list[QLabel] = []
        self._keys: list[tuple[str, str]] = []  # (source, suffix) each label shows
        self.renders = 0  # blocks rendered so far (tests check that a stream re-renders only its tail)

    def _label(self, i: int) -> QLabel:
        while len(self._labels) <= i:
            lab = _BlockLabel()
            lab.setObjectName(self._object_name)
            lab.setWordWrap(True)
            lab.setTextFormat(Qt.TextFormat.RichText)
            lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                        | Qt.TextInteractionFlag.LinksAccessibleByMouse)
            lab.setOpenExternalLinks(False)
            lab.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
            self._lay.addWidget(lab)
            self._labels.append(lab)
            self._keys.append(("\0", ""))
        return self._labels[i]

    def _trim(self, n: int) -> None:
        while len(self._labels) > n:
            lab = self._labels.pop()
            self._keys.pop()
            lab.hide()
            lab.setParent(None)
            lab.deleteLater()

    def set_markdown(self, text: str, streaming: bool = False, suffix: str = "") -> None:
        """Show `text`; `suffix` (HTML, e.g. a cursor) follows the last block."""
        blocks = split_blocks(text)
        if streaming:
            blocks = [p for b in blocks for p in stream_pieces(b)]
        groups = group_blocks(blocks)
        for i, group in enumerate(groups):
            key = ("\n\n".join(group), suffix if i == len(groups) - 1 else "")
            if self._keys[i:i + 1] == [key]:
                continue
            html = "".join(to_html(b) for b in group)
            if key[1] and html.endswith("</p>"):  # the cursor goes on the text's last line
                html = html[:-4] + key[1] + "</p>"
            else:
                html += key[1]
            self._label(i).setText(html)
            self._keys[i] = key
            self.renders += 1
        self._trim(len(groups))

    def set_html(self, html: str) -> None:
        """One label of ready HTML (a user's own text, a placeholder)."""
        key = ("\0html", html)
        if self._keys != [key]:
            self._trim(0)
            self._label(0).setText(html)
            self._keys[0] = key

    def text(self) -> str:
        """The HTML shown, all blocks together."""
        return "".join(lab.text() for lab in self._labels)
