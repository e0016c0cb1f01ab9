"""User settings: one JSON file in the platform's config folder, defaults from minecart.resources.

Holds model folders, sampling defaults, the system prompt and, per model file, the layer plan the user
applied last (so the layer map comes back as it was left). Writes are atomic (temp file + os.replace), so
a crash never leaves a half-written settings file. No widgets here.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from importlib import resources
from pathlib import Path

import platformdirs

APP_NAME = "minecart"


def config_dir() -> Path:
    override = os.environ.get("MINECART_CONFIG_DIR")
    return Path(override) if override else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def data_dir() -> Path:
    override = os.environ.get("MINECART_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def atomic_write_text(path: Path, text: str) -> None:
    """Write text so readers see the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def default_settings() -> dict:
    raw = resources.files("minecart.resources").joinpath("default_settings.json").read_text("utf-8")
    return json.loads(raw)


def _fits(default, value) -> bool:
    """Whether a loaded value can stand in for the default: same kind (numbers mix, finite only)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, type(default))


def _merge(defaults: dict, loaded: dict) -> dict:
    """Defaults overlaid with the loaded values. A value of the wrong kind (a hand edit, an old
    version) keeps the default, so a widget never gets a string where it needs a number."""
    out = copy.deepcopy(defaults)
    for k, v in loaded.items():
        if k in out and not _fits(out[k], v):
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "plans":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class Settings:
    """Dictionary-like settings with `save()`; unknown or broken files fall back to the defaults."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else config_dir() / "settings.json"
        self.data = default_settings()
        self.load_error = ""
        if self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text("utf-8"))
                if isinstance(loaded, dict):
                    self.data = _merge(self.data, loaded)
            except (OSError, ValueError) as exc:
                # keep the unreadable file for the user (the next save would overwrite it)
                kept = self.path.with_name(self.path.name + ".broken")
                try:
                    os.replace(self.path, kept)
                    self.load_error = f"{self.path}: {exc}; using defaults (the old file is kept as {kept})"
                except OSError:
                    self.load_error = f"{self.path}: {exc}; using defaults"

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)

    def __setitem__(self, key, value):
        self.data[key] = value

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=2, sort_keys=True))

    # Per-model layer plans are keyed by the file's resolved path and size, so a re-downloaded file with
    # another size does not inherit a plan made for different tensors.
    @staticmethod
    def plan_key(model_path) -> str:
        p = Path(model_path)
        try:
            return f"{p.resolve()}|{p.stat().st_size}"
        except OSError:
            return str(p)

    def plan_for(self, model_path) -> dict | None:
        return self.data.setdefault("plans", {}).get(self.plan_key(model_path))

    def remember_plan(self, model_path, plan: dict) -> None:
        self.data.setdefault("plans", {})[self.plan_key(model_path)] = plan
        self.save()
