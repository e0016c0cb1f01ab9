"""Memory-mapped access to a GGUF file: metadata as Python values, tensors as raw quantized blocks.

This module reads and validates the container with its own small, bounds-checked parser (the layout is
in docs/qwen35.md 2.1). Every count, length and offset in the header is checked against the
file size before anything is allocated, so a corrupt or hostile file fails fast with a GGUFError that
names the file, the key or tensor, and what would fix it, instead of hanging, allocating gigabytes, or
raising an IndexError deep inside a library.

It does not know model architectures (see config.py) and never copies tensor data into RAM:
`TensorInfo.raw` is a read-only view into the file's memory map, so opening a 30 GB model costs only the
metadata parse (dominated by the ~250k-entry token and merge lists).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .errors import GGUFError, MissingKeyError, MissingTensorError, UnsupportedQuantError
from .quants import BLOCK_SIZES, GGML_TYPES, dequantize, dequantize_rows

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; v2 and v3 share the little-endian layout
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM_VALUE = (1 << 63) - 1  # GGML sizes are int64
MAX_KEY_BYTES = 65535  # the GGUF spec bounds key length
# No real model has arrays this long (vocabularies are ~262k); a larger count means a corrupt file, and
# refusing it keeps a 30 GB file full of garbage from becoming a list of a billion Python objects.
MAX_ARRAY_LEN = 1 << 22  # 4.2M; real vocabularies and merge lists stay below 300k
MAX_ARRAY_DEPTH = 3

# GGUF metadata value types: id -> (name, numpy dtype or None for string/array)
_VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<u1"),
    1: ("INT8", "<i1"),
    2: ("UINT16", "<u2"),
    3: ("INT16", "<i2"),
    4: ("UINT32", "<u4"),
    5: ("INT32", "<i4"),
    6: ("FLOAT32", "<f4"),
    7: ("BOOL", "<u1"),
    8: ("STRING", None),
    9: ("ARRAY", None),
    10: ("UINT64", "<u8"),
    11: ("INT64", "<i8"),
    12: ("FLOAT64", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_FIX_CORRUPT = "the file is damaged or incomplete: re-download it (compare its size/checksum) or re-convert it"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, still quantized.

    shape:  logical row-major shape (GGUF `ne` reversed), e.g. (n_out, n_in) for a matrix.
    raw:    read-only uint8 view of the file bytes (memory-mapped, never copied), shape
            (*shape[:-1], bytes_per_row) for 2-D+, or flat for 1-D. Quantization blocks run along the
            last logical dimension.
    offset: absolute byte offset of the data in the file.
    """

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray
    n_bytes: int
    offset: int = 0

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Reader:
    """A cursor over the mapped file that never reads past the end; errors name the file."""

    def __init__(self, buf, size: int, path: Path):
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0

    def fail(self, message: str, *, key: str | None = None, tensor: str | None = None) -> NoReturn:
        raise GGUFError(self.path, message, key=key, tensor=tensor)

    def need(self, n: int, what: str, *, key=None, tensor=None) -> None:
        if n > self.size - self.pos:
            self.fail(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, but the file ends at "
                f"{self.size}; {_FIX_CORRUPT}",
                key=key,
                tensor=tensor,
            )

    def u32(self, what: str, **kw) -> int:
        self.need(4, what, **kw)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str, **kw) -> int:
        self.need(8, what, **kw)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, *, limit: int | None = None, **kw) -> str:
        n = self.u64(f"the length of {what}", **kw)
        if limit is not None and n > limit:
            self.fail(f"{what} claims {n} bytes (at most {limit} allowed); {_FIX_CORRUPT}", **kw)
        self.need(n, what, **kw)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8; {_FIX_CORRUPT}", **kw)

    def value(self, vtype: int, key: str, depth: int = 0) -> tuple[Any, str]:
        """One metadata value of type id `vtype` -> (Python value, type name)."""
        if vtype not in _VALUE_TYPES:
            self.fail(f"unknown value type id {vtype}; {_FIX_CORRUPT}", key=key)
        name, dtype = _VALUE_TYPES[vtype]
        if vtype == _STRING:
            return self.string("the string value", key=key), name
        if vtype == _ARRAY:
            return self.array(key, depth)
        size = np.dtype(dtype).itemsize
        self.need(size, f"a {name} value", key=key)
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0]
        self.pos += size
        return (bool(v) if vtype == _BOOL else v.item()), name

    def array(self, key: str, depth: int) -> tuple[list, str]:
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"arrays nested deeper than {MAX_ARRAY_DEPTH}; {_FIX_CORRUPT}", key=key)
        etype = self.u32("the array element type", key=key)
        count = self.u64("the array length", key=key)
        if etype not in _VALUE_TYPES:
            self.fail(f"unknown array element type id {etype}; {_FIX_CORRUPT}", key=key)
        ename, dtype = _VALUE_TYPES[etype]
        # every element takes at least 1 byte (8 for a string's length), so the remaining file bounds
        # the count before anything is allocated
        min_size = np.dtype(dtype).itemsize if dtype else (8 if etype == _STRING else 12)
        if count > MAX_ARRAY_LEN or count * min_size > self.size - self.pos:
            self.fail(
                f"array of {count} {ename} elements cannot fit in the rest of the file "
                f"({self.size - self.pos} bytes) or exceeds {MAX_ARRAY_LEN}; {_FIX_CORRUPT}",
                key=key,
            )
        type_label = f"ARRAY[{ename}]"
        if etype == _STRING:
            return self._string_array(count, key), type_label
        if etype == _ARRAY:
            return [self.array(key, depth + 1)[0] for _ in range(count)], type_label
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * arr.itemsize
        if etype == _BOOL:
            return (arr != 0).tolist(), type_label
        return arr.tolist(), type_label

    def _string_array(self, count: int, key: str) -> list[str]:
        # The hot loop of opening a model (two ~250k-entry lists): one unpack, one slice, one decode per
        # string. Running off the end surfaces as struct.error; a too-long length is checked per string.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        decode = bytes.decode  # utf-8, strict; a little faster than str(b, "utf-8")
        out = [""] * count
        i, n = 0, 8
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    break
                out[i] = decode(buf[pos : pos + n])
                pos += n
            else:
                self.pos = pos
                return out
        except struct.error:  # fewer than 8 bytes left for the length
            pass
        except UnicodeDecodeError:
            self.fail(f"string {i} of the array is not valid UTF-8; {_FIX_CORRUPT}", key=key)
        self.pos = pos
        self.need(n, f"string {i} of the array (or its length)", key=key)
        raise AssertionError("need() raises for a string that does not fit")


class GGUFFile:
    """An opened GGUF file. `metadata` maps key -> Python value; `tensors` maps name -> TensorInfo.

    Use as a context manager (or call `close()`) to release the memory map deterministically.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, str] = {}  # key -> GGUF type name, e.g. "UINT32", "ARRAY[STRING]"
        self.tensors: dict[str, TensorInfo] = {}
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self._mmap: mmap.mmap | None = None
        if not self.path.is_file():
            raise GGUFError(self.path, "file not found (or not a regular file); check the path")
        try:
            self.file_size = os.path.getsize(self.path)
            if self.file_size < 24:
                raise GGUFError(
                    self.path,
                    f"truncated: {self.file_size} bytes is shorter than a GGUF header (24 bytes); "
                    f"{_FIX_CORRUPT}",
                )
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(self.path, f"cannot read the file ({exc}); check its permissions") from exc
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing -----------------------------------------------------------------------------------

    def _parse(self) -> None:
        assert self._mmap is not None  # opened by __init__
        r = _Reader(self._mmap, self.file_size, self.path)
        magic = bytes(self._mmap[0:4])
        if magic != GGUF_MAGIC:
            hint = ""
            if magic in (b"ggml", b"ggjt", b"ggmf", b"lmgg", b"fmgg", b"tjgg"):
                hint = " It is an old GGML/GGJT model: convert it to GGUF with a current llama.cpp."
            elif magic[:2] == b"PK" or magic[:1] == b"{":
                hint = (" It looks like a PyTorch/safetensors or JSON file, not a GGUF model: convert the "
                        "checkpoint with llama.cpp's convert_hf_to_gguf.py.")
            raise GGUFError(
                self.path,
                f"not a GGUF file (starts with {magic!r}, expected b'GGUF').{hint or ' Check that you picked the .gguf model file.'}",
            )
        r.pos = 4
        version = r.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            if version in (0x02000000, 0x03000000):
                msg = ("big-endian GGUF is not supported; re-convert the model without --bigendian "
                       "(the standard little-endian layout)")
            elif version == 1:
                msg = "GGUF version 1 is obsolete; re-convert the model with a current llama.cpp"
            else:
                msg = (f"unsupported GGUF version {version} (minecart reads versions "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert the model or update minecart")
            raise GGUFError(self.path, msg)
        self.version = version
        n_tensors = r.u64("the tensor count")
        n_kv = r.u64("the metadata count")
        # each key/value pair takes at least 13 bytes (8 key length, 1 key byte, 4 type, 0+ value),
        # each tensor info at least 29; this bounds both counts by the file size before any loop
        if n_kv * 13 > self.file_size - r.pos:
            r.fail(f"header claims {n_kv} metadata entries, more than the file can hold (truncated or corrupt); {_FIX_CORRUPT}")
        if n_tensors * 29 > self.file_size - r.pos:
            r.fail(f"header claims {n_tensors} tensors, more than the file can hold (truncated or corrupt); {_FIX_CORRUPT}")
        for i in range(n_kv):
            key = r.string(f"the name of metadata entry {i}", limit=MAX_KEY_BYTES)
            vtype = r.u32("the value type", key=key)
            value, tname = r.value(vtype, key)
            if key in self.metadata:
                r.fail("the key appears twice; " + _FIX_CORRUPT, key=key)
            self.metadata[key] = value
            self.value_types[key] = tname
        self.alignment = self._read_alignment()
        infos = [self._read_tensor_info(r, i) for i in range(n_tensors)]
        self.data_offset = -(-r.pos // self.alignment) * self.alignment
        if self.data_offset > self.file_size and infos:
            r.fail(f"truncated: the tensor data section would start at {self.data_offset}, past the end "
                   f"of the file ({self.file_size} bytes); {_FIX_CORRUPT}")
        self._place_tensors(infos)

    def _read_alignment(self) -> int:
        key = "general.alignment"
        if key not in self.metadata:
            return DEFAULT_ALIGNMENT
        a = self.metadata[key]
        if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1) or a > 1 << 30:
            raise GGUFError(self.path, f"alignment {a!r} is not a positive power of two; {_FIX_CORRUPT}",
                            key=key)
        return a

    def _read_tensor_info(self, r: _Reader, i: int):
        name = r.string(f"the name of tensor {i}", limit=MAX_KEY_BYTES)
        n_dims = r.u32("the dimension count", tensor=name)
        if not 1 <= n_dims <= MAX_DIMS:
            r.fail(f"has {n_dims} dimensions (GGML allows 1 to {MAX_DIMS}); {_FIX_CORRUPT}", tensor=name)
        ne = [r.u64("a dimension", tensor=name) for _ in range(n_dims)]
        # llama.cpp's own bounds (int64 sizes): checked before any shape is built, so a zero dimension
        # beside a huge one cannot reach numpy as an unrepresentable shape
        n_elements = 1
        for d in ne:
            n_elements *= max(d, 1)
        if max(ne) > MAX_DIM_VALUE or n_elements > MAX_DIM_VALUE:
            r.fail(f"dimensions {ne} exceed the largest tensor GGML can address (2**63 - 1 "
                   f"elements); {_FIX_CORRUPT}", tensor=name)
        type_id = r.u32("the tensor type", tensor=name)
        offset = r.u64("the data offset", tensor=name)
        if type_id not in GGML_TYPES:
            raise UnsupportedQuantError(
                self.path,
                f"unknown GGML tensor type id {type_id}: the file is corrupt or comes from a llama.cpp newer "
                "than minecart; re-quantize it to a common type (Q8_0, Q4_K_M) with llama-quantize",
                tensor=name,
            )
        block_values, block_bytes = BLOCK_SIZES[type_id]
        if ne[0] % block_values:
            r.fail(f"rows of {ne[0]} values are not a whole number of {GGML_TYPES[type_id].name} blocks "
                   f"({block_values} values); {_FIX_CORRUPT}", tensor=name)
        n_rows = 1
        for d in ne[1:]:
            n_rows *= d
        n_bytes = ne[0] // block_values * block_bytes * n_rows  # Python ints: no overflow
        if offset % self.alignment:
            r.fail(f"data offset {offset} is not a multiple of the alignment {self.alignment}; "
                   f"{_FIX_CORRUPT}", tensor=name)
        return name, tuple(reversed(ne)), type_id, offset, n_bytes

    def _place_tensors(self, infos) -> None:
        assert self._mmap is not None  # opened by __init__
        data_size = self.file_size - self.data_offset
        spans = []
        for name, shape, type_id, offset, n_bytes in infos:
            if name in self.tensors:
                raise GGUFError(self.path, f"two tensors have this name; {_FIX_CORRUPT}", tensor=name)
            if offset > data_size or n_bytes > data_size - offset:
                raise GGUFError(
                    self.path,
                    f"truncated: the data ({n_bytes} bytes at offset {offset} of the data section) runs "
                    f"past the end of the file ({data_size} bytes of data); {_FIX_CORRUPT}",
                    tensor=name,
                )
            start = self.data_offset + offset
            if n_bytes:
                raw = np.frombuffer(self._mmap, dtype=np.uint8, count=n_bytes, offset=start)
                if len(shape) > 1:
                    raw = raw.reshape(*shape[:-1], -1)
            else:  # an empty tensor: nothing to map
                raw = np.empty((*shape[:-1], 0) if len(shape) > 1 else (0,), dtype=np.uint8)
            tname = GGML_TYPES[type_id].name
            self.tensors[name] = TensorInfo(name, type_id, tname, shape, raw, n_bytes, start)
            if n_bytes:
                spans.append((offset, offset + n_bytes, name))
        spans.sort()
        for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:], strict=False):
            if start_b < end_a:
                raise GGUFError(self.path, f"its data overlaps tensor '{name_a}'; {_FIX_CORRUPT}",
                                tensor=name_b)

    # -- access ------------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise MissingKeyError(self.path, "required metadata key is missing; the file may come from an "
                                  "old or foreign converter: re-convert it with a current llama.cpp", key=key)
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        if self.closed:
            raise GGUFError(self.path, "the file was closed; open it again to read tensors", tensor=name)
        if name not in self.tensors:
            raise MissingTensorError(self.path, "required tensor is missing; the file is incomplete or was "
                                     "converted for another architecture", tensor=name)
        return self.tensors[name]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its logical row-major shape."""
        return dequantize(self.tensor(name), path=self.path)

    def dequantize_rows(self, name: str, rows) -> np.ndarray:
        """Some rows of a 2-D+ tensor as float32 (e.g. an embedding lookup)."""
        return dequantize_rows(self.tensor(name), rows, path=self.path)

    def close(self) -> None:
        """Release the memory map. Arrays already taken from `TensorInfo.raw` stay valid (they keep the
        mapping alive until they are dropped); this object no longer hands out tensors."""
        mm, self._mmap = self._mmap, None
        self.tensors = {}
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are still exported; the map is unmapped when the last one is freed

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {state})"
