"""kernels/sass.py: a kernel's machine code read on a machine without a GPU (NVRTC 12's cubin,
disassembled by nvdisasm from the `nvidia-cuda-nvdisasm` wheel of the `test` extra).

The parser is checked on a written listing; then real kernels compiled here are checked against what
their source fixes (gemm_batch's DP4A count a stage, no tensor-core opcode in any matmul module)."""

from __future__ import annotations

import io

import pytest
from minecart.kernels import check, sass
from minecart.kernels.build import module_specs

try:
    check.Nvrtc()
    HAVE_NVRTC = True
except (check.NvrtcError, OSError):
    HAVE_NVRTC = False
needs_tools = pytest.mark.skipif(not HAVE_NVRTC or sass.find_nvdisasm() is None,
                                 reason="needs the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvdisasm wheels")

LISTING = """
//--------------------- .text.k --------------------------
        .section        .text.k,"ax",@progbits
k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R2, RZ ;
.L_x_0:
        /*0020*/                   LDS.128 R4, [R0] ;
        /*0030*/                   IDP.4A.S8.S8 R2, R4, R5, R2 ;
        /*0040*/                   FFMA R3, R2, R2, R3 ;
        /*0050*/              @!P0 BRA `(.L_x_0) ;
        /*0060*/                   HFMA2.MMA R7, -RZ, RZ, 1, 0 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0090*/                   EXIT ;
other:
        /*0000*/                   HMMA.16816.F32 R0, R4, R8, R0 ;
"""


def test_parse_resolves_labels_and_finds_the_loop():
    fns = sass.parse(LISTING)
    assert sorted(fns) == ["k", "other"]
    k = fns["k"]
    assert [i.addr for i in k] == list(range(0, 0xA0, 0x10))
    assert k[5].opcode == "BRA" and k[5].target == 0x20  # backward: the loop
    assert k[7].target == 0x90  # forward: not a loop
    (loop,) = sass.loops(k)
    assert (loop.start, loop.end) == (0x20, 0x50)
    m = sass.mix(loop.body(k))
    assert (m["total"], m["dp4a"], m["fp32"], m["shared"], m["other"]) == (4, 1, 1, 1, 1)


def test_tensor_core_opcodes_but_not_hfma2_mma():
    fns = sass.parse(LISTING)
    assert sass.tensor_core(fns["k"]) == []  # HFMA2.MMA is an fp16 FMA
    assert [i.opcode for i in sass.tensor_core(fns["other"])] == ["HMMA.16816.F32"]


def test_unknown_module_or_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="no module"):
        sass.module_sass("no_such_module", ["k"], nvdisasm="/bin/true")
    with pytest.raises(ValueError, match="has no kernel"):
        sass.module_sass("matmul_Q8_0", ["gemm_batch<99, 8>"], nvdisasm="/bin/true")


@needs_tools
@pytest.mark.parametrize("qt, module", [(8, "matmul_Q8_0"), (12, "matmul_Q4_K")])
def test_gemm_batch_main_loop_issues_its_stage_of_dp4a(qt, module):
    """gemm_batch's rows map at 8 tokens: a lane dots 2 rows x 8 tokens x 8 words a stage (gemm.cu), so
    the loop holding the DP4As issues a whole number of stages of 128, and only that loop issues them."""
    kernel = f"gemm_batch<{qt}, 8>"
    instrs = sass.module_sass(module, [kernel])[kernel]
    total = sass.mix(instrs)["dp4a"]
    assert total > 0 and total % 128 == 0
    with_dp4a = [lp for lp in sass.loops(instrs) if sass.mix(lp.body(instrs))["dp4a"]]
    assert with_dp4a
    assert sass.mix(with_dp4a[0].body(instrs))["dp4a"] == total  # the outermost such loop holds them all
    out = io.StringIO()
    sass.report(instrs, out=out)
    assert "whole kernel" in out.getvalue() and "IDP.4A" in out.getvalue()


@needs_tools
def test_no_tensor_core_opcode_in_the_matmul_machine_code():
    """Every DP4A / FMA matmul kernel of two formats as sm_90 machine code: no tensor-core opcode (the
    PTX guard's result, checked after ptxas)."""
    for module in ("matmul_Q8_0", "matmul_Q4_K"):
        spec = next(s for s in module_specs() if s.name == module)
        kernels = [e for e in spec.name_expressions if e.startswith(("gemm_batch", "gemv_dp4a<", "gemm_fma"))]
        for kernel, instrs in sass.module_sass(module, kernels).items():
            assert instrs and sass.tensor_core(instrs) == [], (module, kernel)


@needs_tools
def test_cli_prints_the_table(capsys):
    assert sass.main(["--module", "matmul_Q8_0", "--kernel", "gemm_batch<8, 8>"]) == 0
    out = capsys.readouterr().out
    assert "gemm_batch<8, 8> (matmul_Q8_0, sm_90)" in out and "loop 0x" in out
    assert sass.main(["--module", "matmul_Q8_0", "--kernel", "nope"]) == 2
