"""The PTX route (MINECART_KERNEL_PTX): `python -m minecart.kernels.check --emit-ptx DIR --arch compute_61`
writes every module and instantiation get_kernel can ask for, with the name-expression -> lowered-symbol
map, and kernels/build.py resolves each request from it or says clearly what is missing or stale.

Runs without a GPU or CuPy (the loading itself, cupy.RawModule(path=...), is checked by
tests/gpu/test_ptx_route.py under tools/gpu_runner.sh ptx). Emitting needs the `nvidia-cuda-nvrtc-cu12`
wheel (the `test` extra)."""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest
from minecart.kernels import build, check

try:
    check.Nvrtc()
    HAVE_NVRTC = True
except (check.NvrtcError, OSError):
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="nvidia-cuda-nvrtc-cu12 is not installed")
KERNELS = Path(build.__file__).resolve().parent


@pytest.fixture(scope="module")
def ptx61(tmp_path_factory):
    """A compute_61 PTX directory of this tree (every module; ~15 s on two cores)."""
    d = tmp_path_factory.mktemp("ptx61")
    out = io.StringIO()
    status = check.emit_ptx(d, "compute_61", jobs=2, out=out)
    assert status == 0, out.getvalue()
    return d


@needs_nvrtc
def test_emitted_directory_resolves_every_request(ptx61):
    manifest = json.loads((ptx61 / build.PTX_MANIFEST).read_text())
    assert manifest["arch"] == "compute_61"
    assert set(manifest["modules"]) == {s.name for s in build.module_specs()}
    requests = build.kernel_requests()
    assert len(requests) > 300  # every matmul type's instantiations, attention head dims, ...
    assert build.verify_ptx_dir(ptx61) == []
    entries: dict[Path, set[str]] = {}
    for module, name in requests:
        path, symbol = build.ptx_symbol(ptx61, module, name, manifest)
        if path not in entries:
            entries[path] = set(check.ptx_entries(path.read_text()))
        assert symbol in entries[path], (module, name, symbol)
        if "<" in name:  # a template instantiation resolves to its mangled symbol, not its spelling
            assert symbol.startswith("_Z"), (module, name, symbol)
    # compute_61 PTX: the sm_61 paths (DP4A exists there; no tensor-core instruction)
    q8 = (ptx61 / "matmul_Q8_0.ptx").read_text()
    assert ".target sm_61" in q8 and "dp4a.s32.s32" in q8
    assert not check.tensor_core_lines(q8)


@needs_nvrtc
def test_emitted_ptx_flushes_subnormals_as_the_engines_build_does(ptx61):
    """CuPy builds every kernel with -ftz=true added after the caller's options, so the PTX that stands
    for that build carries the same flag: its fp32 division, the q8_1 quantizer's, is the flush-to-zero
    form. Compiled from COMPILE_OPTIONS alone, the same source keeps subnormals (docs/BENCHMARKS.md v49:
    the compute_61 / compute_70 PTX quantized a subnormal block that the native build flushed)."""
    assert build.BUILT_OPTIONS[-1] == "-ftz=true"
    manifest = json.loads((ptx61 / check.PTX_MANIFEST).read_text())
    assert manifest["options"] == list(build.BUILT_OPTIONS)
    ptx = (ptx61 / "quantize.ptx").read_text()
    assert re.search(r"\bdiv\.rn\.ftz\.f32\b", ptx)
    assert not re.search(r"\bdiv\.rn\.f32\b", ptx)
    spec = next(sp for sp in build.module_specs() if sp.name == "quantize")
    plain = check.Nvrtc().compile_ptx(build.module_source(spec), spec.name, "compute_61", spec.name_expressions,
                                      build.COMPILE_OPTIONS)
    assert re.search(r"\bdiv\.rn\.f32\b", plain) and ".ftz." not in plain


@needs_nvrtc
def test_emit_ptx_cli_rejects_several_archs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.main(["--emit-ptx", str(tmp_path), "--arch", "compute_61", "--arch", "compute_70"])
    assert "exactly one --arch" in capsys.readouterr().err


def test_normalize_arch():
    assert check.normalize_arch("compute_70") == "sm_70"
    assert check.normalize_arch("sm_61") == "sm_61"
    with pytest.raises(ValueError, match="compute_52"):
        check.normalize_arch("compute_52")


def test_ptx_entries_parses_entry_lines():
    ptx = "\n".join([".visible .entry _Z4gemvILi8EEvPKh(", "\t.param .u64 a", ")",
                     ".entry copy_f4(", "// .entry not_this(", ".func helper("])
    assert check.ptx_entries(ptx) == ["_Z4gemvILi8EEvPKh", "copy_f4"]


def _fake_dir(tmp_path: Path, module: str = "bench", names=None, entries=("copy_f4", "peak_dp4a", "peak_fma"),
              digest: str | None = None) -> Path:
    spec = next(s for s in build.module_specs() if s.name == module)
    (tmp_path / f"{module}.ptx").write_text("// fake\n")
    manifest = {"arch": "compute_70", "modules": {module: {
        "file": f"{module}.ptx", "source_digest": digest or build.source_digest(spec),
        "names": dict(names or {}), "entries": list(entries)}}}
    (tmp_path / build.PTX_MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def test_missing_kernel_module_and_stale_sources_raise_clear_errors(tmp_path):
    d = _fake_dir(tmp_path)
    path, symbol = build.ptx_symbol(d, "bench", "copy_f4")
    assert (path, symbol) == (d / "bench.ptx", "copy_f4")
    with pytest.raises(build.KernelPtxError, match=r"kernel 'no_such' of module 'bench' is not in the PTX "
                                                   r"directory .*MINECART_KERNEL_PTX.*--arch compute_70"):
        build.ptx_symbol(d, "bench", "no_such")
    with pytest.raises(build.KernelPtxError, match=r"module 'gdn' is not in the PTX directory.*--emit-ptx"):
        build.ptx_symbol(d, "gdn", "gdn_scan<64>")
    (tmp_path / "stale").mkdir()
    stale = _fake_dir(tmp_path / "stale", digest="0" * 64)
    with pytest.raises(build.KernelPtxError, match="built from other sources than this tree's; rebuild"):
        build.ptx_symbol(stale, "bench", "copy_f4")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(build.KernelPtxError, match=r"cannot read .*kernels.json.*--emit-ptx"):
        build.ptx_symbol(empty, "bench", "copy_f4")
    # verify_ptx_dir lists every module this directory lacks, and nothing for the one it has
    problems = build.verify_ptx_dir(d)
    assert not any("'bench'" in p for p in problems)
    assert sum("is not in the PTX directory" in p for p in problems) == len(build.module_specs()) - 1
    # a template instantiation missing from the name map is named as such
    d2 = tmp_path / "tmpl"
    d2.mkdir()
    spec = next(s for s in build.module_specs() if s.name == "gdn")
    _fake_dir(d2, "gdn", names={e: f"_Z{i}" for i, e in enumerate(spec.name_expressions[1:])},
              entries=build.extern_c_kernels(spec))
    problems = build.verify_ptx_dir(d2, [spec])
    assert problems == [p for p in problems if spec.name_expressions[0] in p] and len(problems) == 1


def test_ptx_dir_and_build_tag_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(build.PTX_ENV, raising=False)
    assert build.ptx_dir() is None and build.kernel_build_tag() == ""
    d = _fake_dir(tmp_path)
    monkeypatch.setenv(build.PTX_ENV, str(d))
    assert build.ptx_dir() == d.resolve()
    assert build.kernel_build_tag() == "ptx-compute_70"


# ---- every get_kernel call site asks for something the registry builds ----------------------------------
def _pattern(node: ast.expr) -> str:
    """A regex for the string an argument evaluates to: literal text, f-string holes as `.+`, anything
    else (a variable, a call) as `.*`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values)
    return ".*"


def _call_sites() -> list[tuple[str, int, str, str]]:
    """(file, line, module pattern, name pattern) of each get_kernel(...) and ops._mm_kernel(w, name)
    (which asks module matmul_<type>) in kernels/*.py."""
    out = []
    for py in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(py.read_text())):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            fn = (node.func.id if isinstance(node.func, ast.Name)
                  else node.func.attr if isinstance(node.func, ast.Attribute) else "")
            if fn == "get_kernel":
                out.append((py.name, node.lineno, _pattern(node.args[0]), _pattern(node.args[1])))
            elif fn == "_mm_kernel":
                out.append((py.name, node.lineno, "matmul_.+", _pattern(node.args[1])))
    return out


def test_every_call_site_matches_a_registered_kernel():
    sites = _call_sites()
    assert len(sites) > 40, "the scan found too few get_kernel calls; did the call style change?"
    requests = build.kernel_requests()
    unmatched = [s for s in sites
                 if not any(re.fullmatch(s[2], m) and re.fullmatch(s[3], n) for m, n in requests)]
    assert not unmatched, f"get_kernel asks for kernels no module builds: {unmatched}"
    literal = [s for s in sites if ".*" not in s[3] and ".+" not in s[3]]
    assert len(literal) > 10  # the literal names are checked exactly
