"""minecart's engine: GGUF files, tokenizer, models, backends, placement, generation, server, CLI.

Public API (architecture.md): `load_model(path, placement=None, devices=None, kv_type="f16") -> Model`
and `KV_TYPES`, the KV cache types it runs.
The engine never imports Qt; the desktop app and the HTTP server are clients of it.
"""

from __future__ import annotations

from .errors import MinecartError

__all__ = ["KV_TYPES", "MinecartError", "load_model"]


def __getattr__(name):
    # KV_TYPES: the KV cache types load_model(kv_type=) runs ("f32", "f16", "q8_0", "q3"), from engine/kvquant.py;
    # looked up on first use so importing the package does not import NumPy.
    if name == "KV_TYPES":
        from .kvquant import KV_TYPES

        return KV_TYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(path, placement=None, devices=None, **kwargs):
    """Open a GGUF model and place its layers on devices (default: the best available)."""
    from .model import load_model as _load

    return _load(path, placement=placement, devices=devices, **kwargs)
