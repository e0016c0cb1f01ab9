"""minecart's engine: GGUF files, tokenizer, models, backends, placement, generation, server, CLI.

Public API (architecture.md): `load_model(path, placement=None, devices=None) -> Model`.
The engine never imports Qt; the desktop app and the HTTP server are clients of it.
"""

from __future__ import annotations

from .errors import MinecartError

__all__ = ["MinecartError", "load_model"]


def load_model(path, placement=None, devices=None, **kwargs):
    """Open a GGUF model and place its layers on devices (default: the best available)."""
    from .model import load_model as _load

    return _load(path, placement=placement, devices=devices, **kwargs)
