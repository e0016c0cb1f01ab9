"""Images in the token sequence: placeholder expansion, embedding rows, M-RoPE positions.

The chat template renders each image as `<|vision_start|><|image_pad|><|vision_end|>`. Here the single
`<|image_pad|>` becomes N copies (N = image tokens of that picture), the text model receives the
tower's N embeddings in those rows (Model.forward's `embed_override`), and every token gets a
(t, h, w) position (docs/qwen35-vision.md sections 5 and 6):

    text token:          t = h = w = running position p, then p += 1
    image token (R, C):  (s, s + R, s + C) with s = p at the image's first token (raster order)
    after the image:     p = s + max(rows, cols)

so positions are not token indices after an image. Generation continues at max position + 1 (the
Session keeps that itself).

What this file is not: preprocessing (preprocess.py) or the encoder (encoder.py). `prepare_chat` is the
one entry point generation.py calls for chat messages that carry pictures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
# Qwen3.5/3.6 vocabulary ids, used when the tokenizer cannot be asked
DEFAULT_IDS = {IMAGE_PAD: 248056, VISION_START: 248053, VISION_END: 248054}


@dataclass(frozen=True)
class ImageSpan:
    """Where one image sits in the expanded sequence: token rows [start, start + rows * cols)."""

    start: int
    rows: int  # merged grid height (image tokens per column)
    cols: int

    @property
    def n_tokens(self) -> int:
        return self.rows * self.cols


@dataclass
class PreparedPrompt:
    """Token ids with images expanded, (3, T) positions, embed_override (rows, values) and the spans."""

    ids: list[int]
    positions: np.ndarray
    embed_override: tuple[np.ndarray, np.ndarray] | None
    spans: list[ImageSpan] = field(default_factory=list)
    next_position: int = 0
    boundary: int | None = None  # tokens before the generation prompt (end of the last user turn)

    @property
    def n_image_tokens(self) -> int:
        return sum(s.n_tokens for s in self.spans)

    def generate_kwargs(self) -> dict:
        return {"positions": self.positions, "embed_override": self.embed_override}


# ---------------------------------------------------------------------------------------------------
# messages


def _part_source(part):
    """The image source of a content part, or None for a non-image part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in ("image_url", "input_image") or (kind is None and "image_url" in part):
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        return url if url is not None else part.get("url")
    if kind == "image" or (kind is None and "image" in part):
        for key in ("path", "image", "url", "data"):
            if part.get(key) is not None:
                return part[key]
        image_url = part.get("image_url")
        if isinstance(image_url, dict):
            return image_url.get("url")
        return image_url
    return None


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and (
        part.get("type") in ("image", "image_url", "input_image") or "image" in part or "image_url" in part)


def image_sources(messages) -> list:
    """The pictures of chat messages in the order the template renders their placeholders."""
    sources = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if _is_image_part(part):
                    src = _part_source(part)
                    if src is None:
                        raise RequestError(f"image part {j} of a {m.get('role', '?')} message names no "
                                           "picture (give 'path', 'image' or image_url.url)")
                    sources.append(src)
    return sources


def _is_video_part(part) -> bool:
    return isinstance(part, dict) and (part.get("type") in ("video", "video_url") or "video" in part)


def _parts(message: dict) -> list:
    """A message's content parts (a plain-text content has none)."""
    content = message.get("content")
    return content if isinstance(content, list) else []


def has_images(prompt) -> bool:
    """True for chat messages (a list of dicts) with at least one image (or video) part."""
    if isinstance(prompt, (str, bytes)):
        return False
    try:
        items = list(prompt)
    except TypeError:
        return False
    if not items or not isinstance(items[0], dict):
        return False
    return any(_is_image_part(p) or _is_video_part(p) for m in items if isinstance(m, dict)
               for p in _parts(m))


# ---------------------------------------------------------------------------------------------------
# sequence layout


def special_ids(tokenizer=None) -> dict[str, int]:
    ids = dict(DEFAULT_IDS)
    if tokenizer is not None:
        id_of = tokenizer.id_of
        for text in ids:
            found = id_of(text)
            if found is not None:
                ids[text] = int(found)
    return ids


def expand_image_pads(ids, grids, pad_id: int) -> tuple[list[int], list[ImageSpan]]:
    """Replace the k-th `pad_id` in `ids` by rows*cols copies for grids[k] = (rows, cols) (merged grid).
    Raises RequestError when the number of placeholders differs from the number of images."""
    ids = [int(t) for t in ids]
    n_pads = sum(1 for t in ids if t == pad_id)
    if n_pads != len(grids):
        raise RequestError(f"the prompt has {n_pads} image placeholder(s) but {len(grids)} picture(s) were "
                           "given; the chat template must render one <|image_pad|> per image part")
    out: list[int] = []
    spans: list[ImageSpan] = []
    k = 0
    for t in ids:
        if t == pad_id:
            rows, cols = grids[k]
            spans.append(ImageSpan(len(out), int(rows), int(cols)))
            out.extend([pad_id] * (int(rows) * int(cols)))
            k += 1
        else:
            out.append(t)
    return out, spans


def mrope_positions(n_tokens: int, spans, start: int = 0) -> tuple[np.ndarray, int]:
    """(3, T) int64 (t, h, w) positions for a sequence whose images occupy `spans`; and the position
    of the next token. `start` is the position of token 0 (a continuation)."""
    pos = np.empty((3, n_tokens), dtype=np.int64)
    p = int(start)
    i = 0
    for span in sorted(spans, key=lambda s: s.start):
        n_text = span.start - i
        pos[:, i : span.start] = np.arange(p, p + n_text)
        p += n_text
        R, C = np.meshgrid(np.arange(span.rows), np.arange(span.cols), indexing="ij")
        stop = span.start + span.n_tokens
        pos[0, span.start : stop] = p
        pos[1, span.start : stop] = p + R.reshape(-1)
        pos[2, span.start : stop] = p + C.reshape(-1)
        p += max(span.rows, span.cols)
        i = stop
    pos[:, i:] = np.arange(p, p + n_tokens - i)
    p += n_tokens - i
    return pos, p


def build_prompt(ids, embeddings, pad_id: int, grids) -> PreparedPrompt:
    """PreparedPrompt from template token ids (one pad per image), each image's (N, D) embeddings and
    merged grids (rows, cols)."""
    expanded, spans = expand_image_pads(ids, grids, pad_id)
    for span, emb in zip(spans, embeddings, strict=True):
        if emb.shape[0] != span.n_tokens:
            raise ValueError(f"an image of {span.rows}x{span.cols} tokens came with {emb.shape[0]} embeddings")
    positions, next_pos = mrope_positions(len(expanded), spans)
    override = None
    if spans:
        rows = np.concatenate([np.arange(s.start, s.start + s.n_tokens) for s in spans])
        override = (rows, np.concatenate([np.asarray(e, np.float32) for e in embeddings], axis=0))
    return PreparedPrompt(expanded, positions, override, spans, next_pos)


def prepare_chat(model, messages, *, enable_thinking: bool = True, tools=None,
                 max_image_tokens: int | None = None) -> PreparedPrompt:
    """Render chat `messages` with the model's template, encode their pictures with `model.vision`
    and lay both out (expanded ids, (3, T) positions, embedding rows)."""
    tower = model.vision
    if tower is None:
        raise RequestError("this model cannot read pictures (it has no vision encoder); load it together "
                           "with its mmproj-*.gguf file (beside the model, or --mmproj)")
    if model.chat_template is None or model.tokenizer is None:
        raise RequestError("a prompt with pictures needs the model's chat template and tokenizer")
    if any(_is_video_part(p) for m in messages if isinstance(m, dict) for p in _parts(m)):
        raise RequestError("video input is not supported yet; send a few frames as pictures instead")
    messages, encoded = _encode_pictures(tower, messages, max_image_tokens)
    kwargs = {"enable_thinking": enable_thinking}
    if tools:
        kwargs["tools"] = tools
    text = model.chat_template.render(messages, add_generation_prompt=True, **kwargs)
    ids = model.tokenizer.encode(text, add_special=True)
    pad_id = special_ids(model.tokenizer)[IMAGE_PAD]
    grids = [pre.merged_hw for pre, _ in encoded]
    prepared = build_prompt(ids, [emb for _, emb in encoded], pad_id, grids)
    last = messages[-1] if messages else {}
    if isinstance(last, dict) and last.get("role") in ("user", "tool"):
        base = model.chat_template.render(messages, add_generation_prompt=False, **kwargs)
        if text.startswith(base):
            base_ids = model.tokenizer.encode(base, add_special=True)
            if sum(1 for t in base_ids if t == pad_id) == len(grids):
                expanded, _ = expand_image_pads(base_ids, grids, pad_id)
                if 0 < len(expanded) < len(prepared.ids) and prepared.ids[: len(expanded)] == expanded:
                    prepared.boundary = len(expanded)
    return prepared


def _encode_pictures(tower, messages, max_image_tokens):
    """(messages, [(PreprocessedImage, embeddings)] in template order). A picture of the newest user
    message that cannot be read raises ImageError; one in an earlier turn (deleted or moved since, or
    the turn that already failed) is left out of the prompt, so one bad file does not end the chat."""
    from ..errors import ImageError

    last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                    default=-1)
    kept_messages, encoded = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(p) for p in content):
            kept_messages.append(m)
            continue
        parts = []
        for part in content:
            if not _is_image_part(part):
                parts.append(part)
                continue
            src = image_sources([{"role": m.get("role"), "content": [part]}])[0]
            try:
                encoded.append(tower.encode(src, max_image_tokens=max_image_tokens))
            except ImageError:
                if i >= last_user:
                    raise
                continue  # an old turn's unreadable picture: left out
            parts.append(part)
        kept_messages.append(dict(m, content=parts))
    return kept_messages, encoded
