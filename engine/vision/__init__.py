"""Vision input for Qwen3.5/3.6: the mmproj tower, image preprocessing and image rows in the prompt.

    mmproj.py      load + validate the projector GGUF (VisionTower), find it beside a model
    preprocess.py  Pillow: decode, RGB, smart resize, normalize, patches (bit-exact vs transformers)
    encoder.py     the ViT as pure functions over a Backend
    insert.py      placeholder expansion, embedding rows, M-RoPE (t, h, w) positions

`load_model(path, mmproj=...)` attaches a tower as `model.vision` (attach_vision below); chat messages
with image parts then go through `insert.prepare_chat` inside generation.generate.
"""

from __future__ import annotations

from pathlib import Path

from .insert import PreparedPrompt, prepare_chat
from .mmproj import (
    MmprojMismatchError,
    VisionConfig,
    VisionTower,
    find_mmproj,
    load_vision,
)
from .preprocess import DEFAULT_MAX_IMAGE_TOKENS, PreprocessedImage, preprocess_image

__all__ = [
    "DEFAULT_MAX_IMAGE_TOKENS",
    "MmprojMismatchError",
    "PreparedPrompt",
    "PreprocessedImage",
    "VisionConfig",
    "VisionTower",
    "attach_vision",
    "find_mmproj",
    "load_vision",
    "prepare_chat",
    "preprocess_image",
]


def attach_vision(model_path, text_config, backend=None, mmproj=None,
                  max_image_tokens: int | None = None) -> VisionTower | None:
    """The tower for a text model being loaded: `mmproj` given -> that file (errors if it does not
    fit); None -> an mmproj-*.gguf beside the model that fits it, or None; False -> None."""
    from .mmproj import VISION_TEXT_ARCHITECTURES

    if mmproj is False:
        return None
    if mmproj is None:
        if text_config is None or text_config.architecture not in VISION_TEXT_ARCHITECTURES:
            return None
        found = find_mmproj(model_path, text_config)
        if found is None:
            return None
        mmproj = found
    path = Path(mmproj).expanduser()
    if not path.is_file():
        from ..errors import RequestError

        raise RequestError(f"mmproj file not found: {path} (give the path of the mmproj-*.gguf that came "
                           "with the model)")
    return load_vision(path, text_config, backend, max_image_tokens=max_image_tokens)
