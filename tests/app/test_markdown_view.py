"""Block-wise Markdown: split_blocks cuts where to_html starts afresh, so rendering block by block
gives the whole-message HTML, and a growing message re-renders only its last label."""

from __future__ import annotations

import random

from minecart.app.markdown import split_blocks, to_html
from minecart.app.markdown_view import MarkdownView, stream_pieces

LINES = ["Hello **there**.", "", "```python", "print(1)", "", "x = 2", "```", "- a", "- b", "  more",
         "1. one", "3. three", "| a | b |", "|---|---|", "| 1 | 2 |", "> quote", "# Head", "---",
         "plain `code` text", "~~~", "   ", "\t"]


def test_blocks_render_to_the_whole_message():
    rng = random.Random(7)
    for _ in range(2000):
        text = "\n".join(rng.choice(LINES) for _ in range(rng.randint(0, 30)))
        assert "".join(to_html(b) for b in split_blocks(text)) == to_html(text), text


def test_a_long_code_block_streams_in_pieces_that_stay_code():
    block = "```python\n" + "\n".join(f"x{i} = {i}" for i in range(100)) + "\n```"
    pieces = stream_pieces(block, size=40)
    assert len(pieces) == 3 and all(p.startswith("```python") for p in pieces)
    assert all("<pre" in to_html(p) for p in pieces)


def test_growing_text_re_renders_only_the_tail(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    text = ""
    for i in range(200):
        text += f"Paragraph {i} with **bold** words and a little more text to fill it.\n\n"
        before = view.renders
        view.set_markdown(text, streaming=True)
        assert view.renders - before <= 2  # the last label (and a new one when it fills up)
    assert len(view._labels) < 30
    view.set_markdown(text)
    assert view.text() == to_html(text)


def test_the_cursor_follows_the_last_line_of_text(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("Hello there", streaming=True, suffix="<i>CURSOR</i>")
    assert view.text().endswith("Hello there<i>CURSOR</i></p>")
    view.set_markdown("Hello there")
    assert view.text() == to_html("Hello there")
