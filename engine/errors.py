"""Errors the engine raises. Each message says what went wrong, where, and what would fix it.

Every error derives from MinecartError so callers (CLI, HTTP server, desktop app) can catch one type and
show the message to a person. Nothing here imports numpy, cupy or Qt.
"""

from __future__ import annotations


class MinecartError(Exception):
    """Base class for every error minecart raises on purpose."""


class GGUFError(MinecartError):
    """A GGUF file is unreadable: truncated, corrupt, wrong magic, or inconsistent metadata."""

    def __init__(self, path, message: str, *, key: str | None = None, tensor: str | None = None):
        self.path = str(path)
        self.key = key
        self.tensor = tensor
        where = self.path
        if key:
            where += f", key '{key}'"
        if tensor:
            where += f", tensor '{tensor}'"
        super().__init__(f"{where}: {message}")


class UnsupportedArchitectureError(GGUFError):
    """The file holds a model architecture minecart does not implement."""


class UnsupportedQuantError(GGUFError):
    """A tensor uses a GGML quantization type minecart cannot decode."""


class MissingKeyError(GGUFError):
    """A metadata key the architecture needs is absent."""


class MissingTensorError(GGUFError):
    """A tensor the architecture needs is absent."""


class ShapeMismatchError(GGUFError):
    """A tensor's shape disagrees with the metadata."""


class TokenizerError(MinecartError):
    """The tokenizer metadata is missing or unusable."""


class TemplateError(MinecartError):
    """A chat template failed to render (syntax error, unsafe operation, missing variable)."""


class PlacementError(MinecartError):
    """A layer placement is invalid or does not fit the devices' memory."""


class DeviceError(MinecartError):
    """A compute device is missing, unusable, or ran out of memory."""


class OutOfDeviceMemory(DeviceError):
    """A device had no room left for an allocation (a simulated card's cap: engine/rig.py). The CUDA
    backend's own out-of-memory error is CuPy's, a MemoryError: callers that can wait for memory catch
    both (engine/scheduler.py)."""


class ImageError(MinecartError):
    """An image could not be read or is unsafe to decode (truncated, unsupported, too large)."""


class GenerationCancelled(MinecartError):
    """A generation was cancelled by the caller. Not a failure; the session stays usable.
    `tokens_done`: for a cancelled prefill, the tokens that went through every layer before it."""

    tokens_done: int = 0


class RequestError(MinecartError):
    """A malformed request (HTTP API or CLI arguments) that the caller can correct."""


class ContextFullError(RequestError):
    """A sequence would hold more tokens than the loaded model's context limit (engine/session.py
    context_limit): `needed` tokens were asked for, `limit` fit, the model was trained for `trained`
    (0 = unknown). Raised before any token of the request is computed; the session stays usable."""

    def __init__(self, message: str, *, needed: int, limit: int, trained: int = 0):
        super().__init__(message)
        self.needed = int(needed)
        self.limit = int(limit)
        self.trained = int(trained)
