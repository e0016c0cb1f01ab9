"""Dequantization of GGML block formats to float32 (NumPy). Placeholder delegating to gguf.quants."""

from __future__ import annotations

import numpy as np

from .errors import UnsupportedQuantError


def dequantize(info, path="<memory>") -> np.ndarray:
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        out = gguf.quants.dequantize(np.asarray(info.raw), qtype)
    except NotImplementedError as exc:
        raise UnsupportedQuantError(path, f"quant type {info.type_name} is not supported",
                                    tensor=info.name) from exc
    return np.asarray(out, dtype=np.float32).reshape(info.shape)
