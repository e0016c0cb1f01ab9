"""The PTX route on a GPU: with MINECART_KERNEL_PTX=DIR (set by `bash tools/gpu_runner.sh ptx`), every
kernel really comes from DIR's PTX (the driver JIT-compiled the compute_61 / compute_70 code), so the
rest of the GPU suite in that run tests the Pascal / Volta code paths. Skipped when the variable is unset.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.kernels import build

PTX = build.ptx_dir()
pytestmark = pytest.mark.skipif(PTX is None, reason="MINECART_KERNEL_PTX is not set (tools/gpu_runner.sh ptx)")


def test_kernels_are_loaded_from_the_ptx_directory():
    import cupy as cp

    assert PTX is not None
    want = int(build.read_ptx_manifest(PTX)["arch"].split("_")[1])  # compute_61 -> 61
    assert isinstance(build.get_module("bench"), build.PtxModule)
    copy = build.get_kernel("bench", "copy_f4")  # an extern "C" kernel
    gemv = build.get_kernel("matmul_Q8_0", f"gemv_fma<{build.QT['Q8_0']}, 1>")  # a name expression
    for k in (copy, gemv):
        assert k.ptx_version == want, (k.ptx_version, want)  # the PTX's virtual arch, not the card's
    src = cp.asarray(np.random.default_rng(0).standard_normal(4096 * 4).astype(np.float32))
    dst = cp.full_like(src, cp.nan)
    copy((8,), (128,), (src, dst, np.int64(4096)))
    np.testing.assert_array_equal(cp.asnumpy(dst), cp.asnumpy(src))


def test_a_kernel_missing_from_the_directory_is_a_clear_error():
    with pytest.raises(build.KernelPtxError, match="not in the PTX directory"):
        build.get_kernel("bench", "no_such_kernel")
    with pytest.raises(build.KernelPtxError, match="not in the PTX directory"):
        build.get_kernel("matmul_Q8_0", "gemv_fma<8, 3>")  # never instantiated
