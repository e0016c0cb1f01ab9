"""Chunked (WY / UT-transform) Gated DeltaNet prefill: launches of gdn_chunk_prep and gdn_chunk_state.

What this is: the prefill form of the delta rule (docs/qwen35.md 3.4.1, chunk 64) over the same
arguments as ops.gdn_scan, and the rule that picks between the two (`use_chunked`). The prompt is cut
into segments of GDN_CHUNK_SEGMENT tokens; per segment one launch reduces every (chunk, value head) to
the matrices W, Mq, Kd, U, PU (all chunks in parallel), and a second walks the chunks in order, one block
per value head and 32 value columns. Segments bound the scratch memory: per segment
n_v * segment * (3 dk + 2 dv) floats (168 MB for the 9B shape at 2,048 tokens).

What this is not: decode (the scan with T = 1) or short prompts, where the token-serial scan
(ops.gdn_scan) is faster because the chunked form pays a 64 x (dk + dv) triangular solve per chunk.
"""

from __future__ import annotations

import math

from .build import GDN_CHUNK_KEY_DIMS

GDN_CHUNK = 64  # tokens per chunk (fixed in gdn.cu: GDN_CH)
GDN_CHUNK_SEGMENT = 2048  # tokens per prep/state launch pair (a multiple of GDN_CHUNK)
# Shortest run of tokens that takes the chunked path. The scan costs ~0.9 us per token for the 9B shape
# whatever T is; the chunked form has a fixed cost of two launches plus a prep pass, so it wins from a few
# chunks on (tests/gpu/test_gdn_chunk.py prints both).
GDN_CHUNK_MIN_TOKENS = 256


def use_chunked(T: int, dk: int, dv: int) -> bool:
    """Whether a run of T tokens with key dim dk and value dim dv goes to the chunked kernels."""
    return T >= GDN_CHUNK_MIN_TOKENS and dk in GDN_CHUNK_KEY_DIMS and dv >= 1


def scratch_shapes(T: int, n_v: int, dk: int, dv: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one segment's scratch arrays (the layout gdn.cu documents)."""
    nch = math.ceil(min(T, GDN_CHUNK_SEGMENT) / GDN_CHUNK)
    rows = (n_v, nch, GDN_CHUNK)
    return {"W": rows + (dk,), "Mq": rows + (dk,), "Kd": rows + (dk,), "U": rows + (dv,),
            "PU": rows + (dv,), "decay": (n_v, nch)}


def gdn_chunked(q, k, v, g, beta, state):
    """Same contract as ops.gdn_scan: q, k (T, n_k, dk); v (T, n_v, dv); g, beta (T, n_v); state
    (n_v, dk, dv) fp32 updated in place. Returns (T, n_v, dv) float32."""
    import cupy as cp
    import numpy as np

    from .build import get_kernel
    from .ops import gdn_inputs

    (q, k, v, g, beta), (T, n_k, dk, n_v, dv), out = gdn_inputs(q, k, v, g, beta, state, GDN_CHUNK_KEY_DIMS,
                                                                 "chunked Gated DeltaNet")
    if not T:
        return out
    # gdn_chunk_prep reads q and k rows with 16-byte loads (a contiguous view may start anywhere)
    q, k = (a if a.data.ptr % 16 == 0 else a.copy() for a in (q, k))
    full = scratch_shapes(T, n_v, dk, dv)
    scratch = {name: cp.empty(shape, dtype=cp.float32) for name, shape in full.items()}
    prep = get_kernel("gdn", f"gdn_chunk_prep<{dk}>")
    walk = get_kernel("gdn", f"gdn_chunk_state<{dk}>")
    slices = math.ceil(dv / 32)
    for t_begin in range(0, T, GDN_CHUNK_SEGMENT):
        nch = math.ceil(min(GDN_CHUNK_SEGMENT, T - t_begin) / GDN_CHUNK)
        # the last segment uses the front of the scratch arrays with its own (smaller) chunk count
        W, Mq, Kd, U, PU, decay = (scratch[name].reshape(-1) for name in ("W", "Mq", "Kd", "U", "PU", "decay"))
        prep((nch, n_v), (256,),
             (q, k, v, g, beta, W, Mq, Kd, U, PU, decay, np.int32(t_begin), np.int32(T), np.int32(n_k),
              np.int32(n_v), np.int32(dv)))
        walk((n_v * slices,), (256,),
             (W, Mq, Kd, U, PU, decay, state, out, np.int32(nch), np.int32(t_begin), np.int32(T),
              np.int32(n_v), np.int32(dv)))
    return out
