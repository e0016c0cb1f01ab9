"""Memory-mapped access to a GGUF file: metadata as Python values, tensors as raw quantized blocks.

This module reads and validates the container. It does not know model architectures (see config.py)
and never copies tensor data into RAM: `TensorInfo.raw` is a view into the file's memory map.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import GGUFError, MissingKeyError, MissingTensorError


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, still quantized.

    shape: logical row-major shape (GGUF `ne` reversed), e.g. (n_out, n_in) for a matrix.
    raw:   uint8 view of the file bytes (memory-mapped), shape (rows, bytes_per_row) for 2-D+,
           or flat for 1-D. Quantization blocks run along the last logical dimension.
    """

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFFile:
    """An opened GGUF file. `metadata` maps key -> Python value; `tensors` maps name -> TensorInfo."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(self.path, "file not found; check the path")
        try:
            reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the gguf package raises many types on bad input
            raise GGUFError(self.path, f"not a readable GGUF file ({exc}); re-download or re-convert it") from exc
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for field in reader.fields.values():
            if field.name.startswith("GGUF."):
                continue
            try:
                self.metadata[field.name] = field.contents()
            except Exception as exc:
                raise GGUFError(self.path, f"unreadable value ({exc})", key=field.name) from exc
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
            raw = t.data
            if raw.dtype != np.uint8:
                raw = raw.view(np.uint8).reshape(*raw.shape[:-1], -1) if raw.ndim else raw.view(np.uint8)
            self.tensors[t.name] = TensorInfo(
                name=t.name,
                ggml_type=int(t.tensor_type),
                type_name=t.tensor_type.name,
                shape=shape,
                raw=raw,
                n_bytes=int(t.n_bytes),
            )

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise MissingKeyError(self.path, "required metadata key is missing; the file may come from an "
                                  "old or foreign converter: re-convert it with a current llama.cpp", key=key)
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(self.path, "required tensor is missing; the file is incomplete or was "
                                     "converted for another architecture", tensor=name)
        return self.tensors[name]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its logical row-major shape."""
        from .quants import dequantize

        info = self.tensor(name)
        return dequantize(info, path=self.path)
