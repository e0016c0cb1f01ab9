"""A GGUF writer that writes whatever it is told: wrong value types, impossible counts and dimensions.

`gguf.GGUFWriter` refuses most malformed input, so hostile files for the fuzz and validation tests are
built here: `Forged.from_file` reads a real file (the fixtures) into plain lists, tests edit them, and
`to_bytes` lays them out again in the GGUF v3 layout (docs/qwen35.md 2.1).
Test code only: it does not validate anything on purpose.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minecart.engine.gguf_file import GGUFFile

TYPE_IDS = {"UINT8": 0, "INT8": 1, "UINT16": 2, "INT16": 3, "UINT32": 4, "INT32": 5, "FLOAT32": 6,
            "BOOL": 7, "STRING": 8, "ARRAY": 9, "UINT64": 10, "INT64": 11, "FLOAT64": 12}
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q",
            11: "<q", 12: "<d"}


@dataclass
class Tensor:
    name: str
    ne: list[int]  # GGUF order (fastest-varying first)
    ggml_type: int
    offset: int  # within the data section


@dataclass
class Forged:
    """kv: [(key, type id, value)], an array value as (element type id, [values])."""

    kv: list[tuple[str, int, Any]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    data: bytes = b""
    version: int = 3
    alignment: int = 32
    n_tensors: int | None = None  # forged header counts (None: the true ones)
    n_kv: int | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> Forged:
        with GGUFFile(path) as gf:
            kv = []
            for key, value in gf.metadata.items():
                tname = gf.value_types[key]
                if tname.startswith("ARRAY["):
                    kv.append((key, 9, (TYPE_IDS[tname[6:-1]], list(value))))
                else:
                    kv.append((key, TYPE_IDS[tname], value))
            raw = Path(path).read_bytes()
            tensors = [Tensor(t.name, list(reversed(t.shape)), t.ggml_type, t.offset - gf.data_offset)
                       for t in gf.tensors.values()]
            return cls(kv=kv, tensors=tensors, data=raw[gf.data_offset:], alignment=gf.alignment)

    def set(self, key: str, type_id: int, value: Any) -> Forged:
        self.kv = [e for e in self.kv if e[0] != key] + [(key, type_id, value)]
        return self

    def drop(self, key: str) -> Forged:
        self.kv = [e for e in self.kv if e[0] != key]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version & 0xFFFFFFFF,
                           len(self.tensors) if self.n_tensors is None else self.n_tensors,
                           len(self.kv) if self.n_kv is None else self.n_kv)
        for key, type_id, value in self.kv:
            out += _string(key) + struct.pack("<I", type_id & 0xFFFFFFFF) + _value(type_id, value)
        for t in self.tensors:
            out += _string(t.name) + struct.pack("<I", len(t.ne))
            out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.ne)
            out += struct.pack("<IQ", t.ggml_type & 0xFFFFFFFF, t.offset & (2**64 - 1))
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out) + self.data

    def to_bytes_cached(self) -> bytes:
        """`to_bytes()` of this file as first built (for recipes that only need its size)."""
        cached = self.__dict__.get("_bytes")
        if cached is None:
            cached = self.__dict__["_bytes"] = self.to_bytes()
        return cached

    def write(self, path: str | Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(type_id: int, value: Any) -> bytes:
    if type_id == 8:
        return _string(value)
    if type_id == 9:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack(_FORMATS[type_id], value)
