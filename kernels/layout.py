"""Device layouts of stored weights, one definition for the host (NumPy) and the device (CuPy).

The kernels read Q8_0, Q4_0, Q5_0 and IQ4_NL matrices re-laid out: the rest of each row's blocks
contiguous (`wq`) and their fp16 block scales apart (`wd`, uint16 bits); the K-quants (Q4_K/Q5_K/Q6_K)
are repacked by kernels/kquant_layout.py; every other stored type keeps its GGUF blocks as rows (`wq`
only). `relayout` does that re-layout with whichever array module it is given, so
`kernels/ops.upload_weight` (CuPy, after copying the raw blocks to the device) and the host-RAM expert
stream (NumPy, once at load into page-locked memory, engine/backends/expert_stream.py) make the same
bytes. `array_bytes` gives the sizes of those arrays without making them (what a part's weight arena
holds: engine/backends/cupy_backend.py). Imports numpy only (no CuPy), so the CPU tests check it.

What this is not: the choice of a type's kernel or of F32 decoding for types without one
(kernels/ops.py kept_type), nor the block formats themselves (engine/quants.py).
"""

from __future__ import annotations

from typing import Any

from .kquant_layout import KQUANT_TYPES, wq_row_bytes

# 32-value block types whose fp16 scale (the block's first 2 bytes) the kernels read apart: bytes a block
SPLIT_SCALES = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "IQ4_NL": 18}


def relayout(xp: Any, raw: Any, type_name: str, rows: int, cols: int, empty: Any = None) -> tuple[Any, Any | None]:
    """(wq, wd) of a (rows, cols) matrix whose stored bytes are `raw` (any shape, C order, on xp's side):
    wq (rows, bytes per row) uint8 and wd (rows, cols // 32) uint16 for SPLIT_SCALES types; wq = the
    rows as stored and wd None otherwise. xp: numpy or cupy. empty(shape, dtype): makes the split
    types' wq and wd (default xp.empty; ops.upload_weight passes views of a part's weight arena)."""
    flat = raw.reshape(-1).view(xp.uint8)
    nb = SPLIT_SCALES.get(type_name)
    if nb is None:
        return flat.reshape(rows, -1), None
    if cols % 32 or flat.size != rows * (cols // 32) * nb:
        raise ValueError(f"{type_name} matrix ({rows}, {cols}): {flat.size} bytes are not whole "
                         f"{nb}-byte blocks of 32 values per row")
    empty = xp.empty if empty is None else empty
    blk = flat.reshape(rows, cols // 32, nb)
    wd = empty((rows, cols // 32), xp.uint16)
    wd.view(xp.uint8).reshape(rows, cols // 32, 2)[...] = blk[:, :, :2]
    wq = empty((rows, cols // 32 * (nb - 2)), xp.uint8)
    wq.reshape(rows, cols // 32, nb - 2)[...] = blk[:, :, 2:]
    return wq, wd


def array_bytes(type_name: str, rows: int, cols: int, row_bytes: int) -> tuple[int, int]:
    """(bytes of wq, bytes of wd; 0 = no wd) of a (rows, cols) matrix of `type_name` laid out for the
    kernels (`relayout`, kquant_layout.repack); row_bytes: the bytes of one stored row (what a type
    kept as its blocks holds per row). Exact: the device arrays' nbytes."""
    if type_name in KQUANT_TYPES:
        return rows * wq_row_bytes(type_name, cols), rows * (cols // 32) * 2
    if type_name in SPLIT_SCALES:
        return rows * (cols // 32) * (SPLIT_SCALES[type_name] - 2), rows * (cols // 32) * 2
    return rows * row_bytes, 0
