"""A small Markdown-to-HTML renderer for chat messages, tuned to Qt's rich-text subset.

Handles what models write: paragraphs, headings, bold/italic, inline code, fenced code blocks (with the
language shown), bullet and numbered lists, block quotes, rules, links and simple pipe tables. Unclosed
fences (while a reply is still streaming) render as code so far. Everything is HTML-escaped first; no
images or remote content are ever fetched. Not a CommonMark implementation.

`split_blocks` cuts a text where `to_html` starts afresh (blank lines outside code fences), so a view can
render a long, growing message block by block: to_html(text) == "".join(map(to_html, split_blocks(text))).
"""

from __future__ import annotations

import html
import re

CODE_BG = "#0f1115"
CODE_BORDER = "#2a2f3a"
INLINE_CODE_BG = "#262b36"

_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__")
_ITALIC = re.compile(r"(?<![\*\w])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\*\w])|(?<![_\w])_(?=\S)([^_\n]+?)(?<=\S)_(?![_\w])")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s)]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^(\s*)(\d+)[.)]\s+(.*)$")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+#.-]*)\s*$")
_RULE = re.compile(r"^\s*([-*_])(\s*\1){2,}\s*$")
_TABLE_SEP = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$")


def _inline(text: str) -> str:
    """Escape, then apply inline markup; code spans are protected from the other rules."""
    codes: list[str] = []

    def keep_code(m):
        codes.append(m.group(1))
        return f"\x00{len(codes) - 1}\x00"

    text = _INLINE_CODE.sub(keep_code, text)
    text = html.escape(text, quote=False)
    text = _LINK.sub(lambda m: f'<a href="{html.escape(m.group(2))}">{m.group(1)}</a>', text)
    text = _BOLD.sub(lambda m: f"<b>{m.group(1) or m.group(2)}</b>", text)
    text = _ITALIC.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", text)

    def put_code(m):
        code = html.escape(codes[int(m.group(1))], quote=False)
        return (f'<code style="background:{INLINE_CODE_BG}; font-family:monospace;">'
                f"&nbsp;{code}&nbsp;</code>")

    return re.sub(r"\x00(\d+)\x00", put_code, text)


def _code_block(lang: str, lines: list[str]) -> str:
    code = html.escape("\n".join(lines), quote=False)
    label = (f'<div style="color:#8d96a8; font-size:8pt; margin-bottom:4px;">{html.escape(lang)}</div>'
             if lang else "")
    return (f'<table width="100%" cellspacing="0" cellpadding="10" style="background:{CODE_BG}; '
            f'border:1px solid {CODE_BORDER}; margin-top:6px; margin-bottom:6px;"><tr><td>{label}'
            f'<pre style="font-family:monospace; margin:0; white-space:pre-wrap;">{code}</pre>'
            "</td></tr></table>")


def _table(rows: list[str]) -> str:
    def cells(row: str) -> list[str]:
        row = row.strip()
        if row.startswith("|"):
            row = row[1:]
        if row.endswith("|"):
            row = row[:-1]
        return [c.strip() for c in row.split("|")]

    head = cells(rows[0])
    body = [cells(r) for r in rows[2:]]
    out = ['<table cellspacing="0" cellpadding="5" style="border:1px solid #2c313c; margin:6px 0;">', "<tr>"]
    out += [f'<th style="background:#20242d; text-align:left;">{_inline(c)}</th>' for c in head]
    out.append("</tr>")
    for r in body:
        out.append("<tr>" + "".join(f'<td style="border-top:1px solid #2c313c;">{_inline(c)}</td>' for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)


def to_html(text: str) -> str:
    """Markdown text -> an HTML fragment for QLabel/QTextBrowser."""
    lines = text.replace("\r\n", "\n").split("\n")
    out: list[str] = []
    para: list[str] = []
    list_stack: list[str] = []  # "ul" / "ol"
    i = 0

    def flush_para():
        if para:
            out.append("<p>" + "<br>".join(_inline(p) for p in para) + "</p>")
            para.clear()

    def close_lists():
        while list_stack:
            out.append(f"</{list_stack.pop()}>")

    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            flush_para()
            close_lists()
            marker, lang = fence.group(1), fence.group(2)
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i])
                i += 1
            out.append(_code_block(lang, body))
            i += 1
            continue
        if not line.strip():
            flush_para()
            close_lists()
            i += 1
            continue
        if "|" in line and i + 1 < len(lines) and _TABLE_SEP.match(lines[i + 1]):
            flush_para()
            close_lists()
            rows = [line, lines[i + 1]]
            i += 2
            while i < len(lines) and "|" in lines[i] and lines[i].strip():
                rows.append(lines[i])
                i += 1
            out.append(_table(rows))
            continue
        m = _HEADING.match(line)
        if m:
            flush_para()
            close_lists()
            level = len(m.group(1))
            size = {1: "14pt", 2: "12.5pt", 3: "11.5pt"}.get(level, "10.5pt")
            out.append(f'<p style="font-size:{size}; font-weight:600; margin-top:8px;">{_inline(m.group(2))}</p>')
            i += 1
            continue
        if _RULE.match(line):
            flush_para()
            close_lists()
            out.append("<hr>")
            i += 1
            continue
        if line.lstrip().startswith(">"):
            flush_para()
            close_lists()
            quote = []
            while i < len(lines) and lines[i].lstrip().startswith(">"):
                quote.append(lines[i].lstrip()[1:].lstrip())
                i += 1
            out.append('<table cellpadding="6" style="margin:4px 0;"><tr><td style="border-left:3px solid #4a5163; '
                       f'color:#aab2c2;">{"<br>".join(_inline(q) for q in quote)}</td></tr></table>')
            continue
        mb, mn = _BULLET.match(line), _NUMBERED.match(line)
        if mb or mn:
            flush_para()
            kind = "ul" if mb else "ol"
            depth = (len((mb or mn).group(1).replace("\t", "    ")) // 2) + 1
            while len(list_stack) > depth:
                out.append(f"</{list_stack.pop()}>")
            if len(list_stack) == depth and list_stack[-1] != kind:
                out.append(f"</{list_stack.pop()}>")
            while len(list_stack) < depth:
                if kind == "ol" and mn:
                    out.append(f'<ol start="{int(mn.group(2))}" style="margin-top:2px; margin-bottom:2px;">')
                else:
                    out.append('<ul style="margin-top:2px; margin-bottom:2px;">')
                list_stack.append(kind)
            content = mb.group(2) if mb else mn.group(3)
            out.append(f"<li>{_inline(content)}</li>")
            i += 1
            continue
        if list_stack and line.startswith("  "):
            out[-1] = out[-1].replace("</li>", " " + _inline(line.strip()) + "</li>")
            i += 1
            continue
        close_lists()
        para.append(line)
        i += 1
    flush_para()
    close_lists()
    return "".join(out)


def split_blocks(text: str) -> list[str]:
    """The text's blocks: cut at blank lines outside fenced code, where to_html keeps no state (it
    flushes the paragraph and closes lists there; tables and quotes end there too). The fence rules
    are to_html's own, so both agree on where code starts and ends."""
    blocks: list[str] = []
    current: list[str] = []
    marker = ""  # the open fence's marker, "" outside code
    for line in text.replace("\r\n", "\n").split("\n"):
        if marker:
            current.append(line)
            if line.strip().startswith(marker):
                marker = ""
            continue
        fence = FENCE.match(line)
        if fence:
            marker = fence.group(1)
            current.append(line)
        elif not line.strip():
            if current:
                blocks.append("\n".join(current))
                current = []
        else:
            current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks
