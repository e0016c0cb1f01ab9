"""Programmatic dependent launch (kernels/launch.py, common.cuh pdl_entry): on a card that has it every
kernel may start before the kernel ahead of it in its stream has finished, so every kernel must wait
first. Checked here without a GPU: each kernel's body starts with pdl_entry(); the sm_90 code waits and
the sm_61 code has no such instruction; which cards launch with it. The launches themselves (graph and
eager results equal with and without it) run in tests/gpu/test_pdl.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from minecart.kernels import build, check, launch

KERNELS = Path(build.__file__).resolve().parent


def kernel_bodies(source: str) -> list[tuple[str, str]]:
    """(signature, the body's first statement) of every __global__ definition in a .cu source (comment
    lines skipped, declarations without a body too)."""
    found = []
    for m in re.finditer(r"__global__", source):
        line_start = source.rfind("\n", 0, m.start()) + 1
        if source[line_start:m.start()].lstrip().startswith("//"):
            continue
        depth, j = 0, m.end()
        while j < len(source):
            c = source[j]
            depth += (c == "(") - (c == ")")
            if depth == 0 and c in ";{":
                break
            j += 1
        if j == len(source) or source[j] == ";":
            continue
        body = source[j + 1:].lstrip()
        found.append((_kernel_name(source[m.end():j]), body[:body.find(";") + 1]))
    return found


def _kernel_name(head: str) -> str:
    """The name in a kernel's head (what lies between __global__ and its body): the identifier before
    the parameter list, the last parenthesis at depth 0."""
    depth, start = 0, -1
    for i, c in enumerate(head):
        if c == "(":
            if depth == 0:
                start = i
            depth += 1
        elif c == ")":
            depth -= 1
    return re.findall(r"\w+", head[:start])[-1]


def test_the_scan_sees_a_missing_wait():
    src = ("// __global__ in a comment\n__global__ void a(int* p) {\n    pdl_entry();\n    p[0] = 1;\n}\n"
           "extern \"C\" __global__ void __launch_bounds__(128) b(int* p) {\n    p[0] = 2;\n}\n")
    assert kernel_bodies(src) == [("a", "pdl_entry();"), ("b", "p[0] = 2;")]


# kernels that do something before the wait, and what: the single-token GEMVs, which only touch their
# weights (no kernel writes those) before it
PREFETCH_FIRST = {"gemv_kq"}  # a constexpr, then pdl_entry_prefetch(the block's rows)
LOADS_FIRST = {"gemv_kq_stream", "gemv_dp4a_stream"}  # gemv_stream_body: first weight loads, then the wait
# the single-token Gated DeltaNet reads its layer's recurrent state first: only that kernel writes it, and
# its launch for the token before has ended
STATE_FIRST = {"gdn_decode"}  # float S[DK / 4]; gdn_load_state(...); then the wait
# the single-token decode attention asks for its first keys and values (rows of earlier steps, in graph
# launches that have ended) before the wait, inside flash_decode_body<..., EARLY = true>
CACHE_FIRST = {"flash_decode"}
# the decode norm reads the norm weight of its block's first slice (a weight: no kernel writes it)
WEIGHT_FIRST = {"rms_norm_q8"}
# L2 prefetches only (common.cuh prefetch_line: a hint, never a value read early): the GDN batch's conv
# taps, conv history and states, attn_prep's norm weights and rotary tables
LINES_FIRST = {"gdn_decode_batch": "i64 s = blockIdx.y;", "attn_prep": "attn_prep_prefetch(",
               "attn_prep_batch": "attn_prep_prefetch("}
# the batched decode GEMM: its two thread maps (gb_rows, gb_quads) load their first stage's weights, then wait
MAPS_WAIT = {"gemm_batch"}
EARLY = PREFETCH_FIRST | LOADS_FIRST | STATE_FIRST | CACHE_FIRST | WEIGHT_FIRST | set(LINES_FIRST) | MAPS_WAIT


def _function(src: str, head: str) -> str:
    """The text of the function whose definition starts with `head` (up to its parameter list's opening
    parenthesis), from there to its closing brace at the start of a line."""
    return src.split(head, 1)[1].split("\n}\n")[0]


def _before_wait(file: str, head: str) -> str:
    """A kernel's body (comments dropped) before its pdl_entry()."""
    body = re.sub(r"//[^\n]*", "", _function((KERNELS / file).read_text(), head))
    return body[body.index("{"):body.index("pdl_entry();")]


def test_every_kernel_waits_first():
    sources = sorted(KERNELS.glob("*.cu"))
    bodies = [(f.name, sig, first) for f in sources for sig, first in kernel_bodies(f.read_text())]
    assert len(bodies) > 60, "too few kernels found: did the scan break?"
    missing = [f"{name}: {sig}" for name, sig, first in bodies if first != "pdl_entry();" and sig not in EARLY]
    assert not missing, "kernels whose first statement is not pdl_entry():\n" + "\n".join(missing)
    named = {sig: first for _, sig, first in bodies}
    assert EARLY <= set(named)
    for k in PREFETCH_FIRST:
        assert named[k].startswith("constexpr int RPB"), (k, named[k])
    for k in LOADS_FIRST:
        assert named[k].startswith("gemv_stream_body<"), (k, named[k])
    for k in STATE_FIRST:
        assert named[k] == "float S[DK / 4];", (k, named[k])
    for k in CACHE_FIRST:
        assert named[k].startswith("flash_decode_body<D, GM, true>("), (k, named[k])
    for k, first in LINES_FIRST.items():
        assert named[k].startswith(first), (k, named[k])
    for k in MAPS_WAIT:
        assert named[k].startswith("static_assert("), (k, named[k])


def test_the_batched_gemm_waits_after_its_first_weights_only():
    src = re.sub(r"//[^\n]*", "", (KERNELS / "gemm.cu").read_text())
    kernel = _function(src, "void __launch_bounds__(128, 3) gemm_batch(")
    assert "pdl_entry" not in kernel and "gb_quads<QT, TT>(" in kernel and "gb_rows<QT, TT>(" in kernel
    for name, weights, after in (("gb_rows", "if (st0 < st1) load_w(st0, wa);", "load_x(st0);"),
                                 ("gb_quads", "if (st0 < st1) wload(st0);",
                                  "if (st0 < st1) gb_load_x<TT>(xq, xd, xs, xpos, st0, xv, xcv);")):
        body = _function(src, f"void {name}(")
        assert body.count("pdl_entry();") == 1, name
        before, rest = body.split("pdl_entry();")
        # the last statement before the wait is the weight load; the activations, the group bounds (seg)
        # and every store come after it
        assert before.rstrip().endswith(weights), name
        assert after in rest and "bounds[tid] =" not in before and "store_x(0)" not in before, name


def test_what_runs_before_the_wait_reads_no_activation():
    """Before its wait a kernel may read only what no kernel ahead of it writes: the norm its weight, the
    single-token GDN its state (and L2 hints), the others nothing at all (L2 prefetches only)."""
    norm = _before_wait("fused.cu", "void __launch_bounds__(256) rms_norm_q8(")
    assert "w[i0]" in norm and not re.search(r"\b(x|delta|x4|d4)\[", norm)
    gdn = _before_wait("fused.cu", "void __launch_bounds__(512) gdn_decode(")
    assert "gdn_prefetch<DK>(" in gdn and "gdn_load_state<DK>(" in gdn and "mixed" not in gdn
    for k, file, sig in (("gdn_decode_batch", "fused.cu", "void __launch_bounds__(512, 2) gdn_decode_batch("),
                         ("attn_prep", "attn_prep.cu", "void attn_prep("),
                         ("attn_prep_batch", "attn_prep.cu", "void attn_prep_batch(")):
        head = _before_wait(file, sig)
        assert re.search(r"(gdn|attn_prep)_prefetch", head) and "[" not in head.replace("conv_states[s]", "").replace(
            "states[s]", ""), (k, head)
    src = (KERNELS / "fused.cu").read_text()
    pre = _function(src, "void gdn_prefetch(")
    assert "prefetch_line(" in pre and not re.search(r"=\s*(conv_|ssm_|dt_|norm_|state)\w*\[", pre)


def test_the_decode_attention_reads_this_tokens_row_and_query_after_the_wait():
    src = (KERNELS / "attention.cu").read_text()
    body = _function(src, "void flash_decode_body(")
    early = body.index("fd_load<U, D>(kc, vc, t0, EARLY ? min(hi, p) : hi")  # row p = kv_len - 1 left out
    wait = body.index("pdl_entry();")
    again = body.index("if (t0 < hi && t0 + U > p) fd_load<U, D>(kc, vc, t0, hi,")  # the warp holding row p
    assert early < wait < again < body.index("qs[g][c4] =") < body.index("fd_merge_warps")
    assert body.count("pdl_entry();") == 1 and "if (EARLY) {" in body[early:wait]
    batch = _function(src, "void __launch_bounds__(128, 3) flash_decode_batch(")
    assert batch.index("pdl_entry();") < batch.index("flash_decode_body<D, GM, false>(")


def test_the_streaming_gemvs_wait_before_reading_activations():
    src = (KERNELS / "gemv.cu").read_text()
    gemv = _function(src, "gemv_stream_body(")
    wait = gemv.index("pdl_entry();")
    # the first weights are asked for before the wait; activations are read (S::dot) and outputs written
    # only in the tasks, which the body runs after it
    assert gemv.index("S::load(") < wait < gemv.index("gemv_stream_task<")
    assert "S::dot(" not in gemv and "y[row]" not in gemv
    task = _function(src, "void gemv_stream_task(")
    assert "S::dot(" in task and "y[row]" in task and "pdl_entry" not in task
    for k in PREFETCH_FIRST:
        body = src.split(f"\n{k}(")[1].split("{", 1)[1]
        assert body.index("pdl_entry_prefetch(wq") < min(body.index(x) for x in ("xq", "part[", "y["))


def test_which_cards_launch_with_it(monkeypatch):
    monkeypatch.setattr(launch, "PDL_VARIANT", "auto")
    monkeypatch.setattr(launch, "_driver", object())  # a driver library with cuLaunchKernelEx
    assert launch.pdl_wanted(90) and launch.pdl_wanted(100)
    assert not any(launch.pdl_wanted(cc) for cc in (61, 70, 75, 86, 89))
    monkeypatch.setattr(launch, "PDL_VARIANT", "off")
    assert not launch.pdl_wanted(90)
    monkeypatch.setattr(launch, "PDL_VARIANT", "on")
    with pytest.raises(ValueError, match="MINECART_PDL"):
        launch.pdl_wanted(90)


def test_no_driver_library_means_no_pdl(monkeypatch):
    monkeypatch.setattr(launch, "PDL_VARIANT", "auto")
    monkeypatch.setattr(launch, "_driver", None)

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(launch.ctypes, "CDLL", missing)
    assert not launch.pdl_wanted(90)


def test_launch_dimensions():
    assert launch._dim3((5,)) == (5, 1, 1)
    assert launch._dim3((5, 3)) == (5, 3, 1)
    assert launch._dim3((5, 3, 2)) == (5, 3, 2)
    assert launch._dim3(7) == (7, 1, 1)


try:
    check.Nvrtc()
    HAVE_NVRTC = True
except (check.NvrtcError, OSError):
    HAVE_NVRTC = False


@pytest.mark.skipif(not HAVE_NVRTC, reason="nvidia-cuda-nvrtc-cu12 is not installed")
def test_sm_90_code_waits_and_older_code_has_no_such_instruction():
    spec = next(s for s in build.module_specs() if s.name == "fused")
    nv = check.Nvrtc()
    src = build.module_source(spec)
    new = nv.compile_ptx(src, spec.name, "compute_90", spec.name_expressions, build.COMPILE_OPTIONS)
    old = nv.compile_ptx(src, spec.name, "compute_61", spec.name_expressions, build.COMPILE_OPTIONS)
    entries = len(re.findall(r"\.entry\s", new))
    assert entries >= 6
    assert new.count("griddepcontrol.wait") == entries
    assert new.count("griddepcontrol.launch_dependents") == entries
    assert "griddepcontrol" not in old


def test_code_from_older_ptx_never_starts_early(monkeypatch, tmp_path):
    """compute_61 / compute_70 PTX (tools/gpu_runner.sh ptx, on an sm_90 card) has no wait in pdl_entry:
    its kernels launch without PDL; compute_90 PTX and the compiled sources on that card launch with it."""
    import json

    monkeypatch.setattr(launch, "PDL_VARIANT", "auto")
    monkeypatch.setattr(launch, "_driver", object())
    for arch, want in (("compute_61", False), ("compute_70", False), ("compute_90", True)):
        d = tmp_path / arch
        d.mkdir()
        (d / build.PTX_MANIFEST).write_text(json.dumps({"arch": arch, "modules": {}}))
        assert build.launches_with_pdl(90, d) is want, arch
    assert build.launches_with_pdl(90, None)
    assert not build.launches_with_pdl(70, None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / build.PTX_MANIFEST).write_text(json.dumps({"arch": "sm90", "modules": {}}))
    with pytest.raises(build.KernelPtxError, match="compute_XX"):
        build.launches_with_pdl(90, bad)
