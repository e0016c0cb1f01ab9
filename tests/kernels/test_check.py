"""The CI guard (python -m minecart.kernels.check): every kernel compiles for every supported
architecture with NVRTC 12 and no PTX holds a tensor-core instruction; a planted `mma` is caught.

Runs without a GPU or CuPy; needs the `nvidia-cuda-nvrtc-cu12` wheel (the `test` extra)."""

from __future__ import annotations

import io

import pytest
from minecart.kernels import check
from minecart.kernels.build import ModuleSpec, module_source, module_specs

try:
    check.Nvrtc()
    HAVE_NVRTC = True
except (check.NvrtcError, OSError):
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="nvidia-cuda-nvrtc-cu12 is not installed")

PLANTED = r"""
extern "C" __global__ void planted_mma(float* out, const unsigned* a, const unsigned* b) {
    float d0, d1, d2, d3, d4, d5, d6, d7;
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
                 "{%12,%12,%12,%12,%12,%12,%12,%12};"
                 : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3), "=f"(d4), "=f"(d5), "=f"(d6), "=f"(d7)
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
    out[threadIdx.x] = d0 + d1 + d2 + d3 + d4 + d5 + d6 + d7;
}
"""


def test_tensor_core_lines_matches_opcodes_only():
    ptx = "\n".join([
        "// gemma and mma in a comment",
        ".visible .entry gemma_kernel(",
        "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "\t@%p1 wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f1}, %rd1, %rd2;",
        "\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%rd3];",
        "\ttcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2;",
        "\tdp4a.s32.s32 %r5, %r6, %r7, %r8;",
        "\tfma.rn.f32 %f3, %f4, %f5, %f6;",
    ])
    bad = check.tensor_core_lines(ptx)
    assert [b.split(".")[0].lstrip("@%p1 ") for b in bad] == ["mma", "wgmma", "ldmatrix", "tcgen05"]


@needs_nvrtc
def test_guard_fails_on_planted_mma():
    spec = ModuleSpec("planted", ("bench.cu",), ())
    src = module_source(spec) + PLANTED
    out = io.StringIO()
    status = check.check([spec], archs=("sm_70", "sm_90"), sources={"planted": src}, out=out)
    assert status == 1, out.getvalue()
    assert "TENSOR CORE planted sm_70" in out.getvalue()


@needs_nvrtc
@pytest.mark.timeout(1800)  # ~45 modules x 5 architectures: 6-8 min of NVRTC on a 2-core machine
def test_guard_passes_all_kernels_all_archs(tmp_path):
    out = io.StringIO()
    status = check.check(archs=check.ARCHS, dump=tmp_path, jobs=2, out=out)
    assert status == 0, out.getvalue()
    for arch in check.ARCHS:
        for spec in module_specs():
            ptx = (tmp_path / arch / f"{spec.name}.ptx").read_text()
            assert ".entry" in ptx
            assert not check.tensor_core_lines(ptx)
    # the DP4A kernels really use DP4A
    assert "dp4a.s32.s32" in (tmp_path / "sm_61" / "matmul_Q8_0.ptx").read_text()


def test_probe_cache_roundtrip(tmp_path, monkeypatch):
    from minecart.engine import probe_cache

    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    assert probe_cache.load_all() == {}
    probe_cache.save("GPU-1234", {"name": "CMP 100-210", "gemv": "dp4a", "gemm": "fma", "dp4a_tops": 17.0,
                                  "fma_tflops": 14.1, "copy_gbs": 818.0})
    rec = probe_cache.get("GPU-1234")
    assert rec["gemm"] == "fma" and rec["version"] == probe_cache.VERSION
    line = probe_cache.summary_for("GPU-1234")
    assert "DP4A 17.0 TOPS" in line and "prefill path fma" in line
    assert probe_cache.summary_for("GPU-none") == ""
    (tmp_path / probe_cache.FILE_NAME).write_text("{not json")
    assert probe_cache.load_all() == {}


def test_ptxas_reports_are_parsed_per_kernel():
    log = "\n".join([
        "ptxas info    : 0 bytes gmem",
        "ptxas info    : Compiling entry function '_Z3fooILi8EEvPf' for 'sm_90'",
        "ptxas info    : Function properties for _Z3fooILi8EEvPf",
        "ptxas         .     24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads",
        "ptxas info    : Used 128 registers, used 1 barriers, 24 bytes cumulative stack size, 10276 bytes smem",
        "ptxas info    : Compiling entry function 'bar' for 'sm_90'",
        "ptxas info    : Function properties for bar",
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 32 registers, used 1 barriers, 36 bytes smem",
    ])
    assert check.parse_ptxas_info(log) == [check.KernelResources("_Z3fooILi8EEvPf", 128, 24, 20, 16),
                                           check.KernelResources("bar", 32, 0, 0, 0)]


@needs_nvrtc
def test_resources_names_each_kernel_and_flags_spills():
    """--resources compiles to machine code and reports each instantiation by its template name; a kernel
    forced to spill (a large indexed local array, 32 registers at most) makes it exit 1."""
    from minecart.kernels.build import module_specs

    spec = next(s for s in module_specs() if s.name == "matmul_Q4_K")
    out = io.StringIO()
    assert check.resources([spec], ("sm_90",), r"^gemm_batch<12, 8>$", out=out) == 0, out.getvalue()
    line, verdict = out.getvalue().strip().split("\n")
    assert line.startswith("sm_90 matmul_Q4_K") and "gemm_batch<12, 8>" in line and "registers" in line
    assert verdict == "no spills"
    spilling = ModuleSpec("spill", ("bench.cu",), (), ("spills",))
    src = module_source(ModuleSpec("spill", ("bench.cu",), ())) + r"""
extern "C" __global__ void __launch_bounds__(1024, 2) spills(float* out, const float* in, int n) {
    float v[96];
    #pragma unroll
    for (int i = 0; i < 96; i++) v[i] = in[i * n + threadIdx.x];
    float s = 0.0f;
    #pragma unroll
    for (int i = 0; i < 96; i++) s += v[i] * v[(i * 7) % 96];
    out[threadIdx.x] = s;
}
"""
    out = io.StringIO()
    assert check.resources([spilling], ("sm_90",), sources={"spill": src}, out=out) == 1, out.getvalue()
    assert "spills" in out.getvalue() and out.getvalue().strip().endswith("SPILLS")
