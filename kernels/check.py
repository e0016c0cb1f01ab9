"""CI guard: compile every kernel for every supported architecture and reject tensor-core instructions.

    python -m minecart.kernels.check [--arch sm_61 ...] [--dump DIR] [--jobs N]
    python -m minecart.kernels.check --emit-ptx DIR --arch compute_61
    python -m minecart.kernels.check --resources [REGEX] [--module M] [--arch sm_90]

Compiles each module of build.module_specs() (every template instantiation) to PTX with NVRTC 12.x,
loaded through ctypes from the PyPI wheel `nvidia-cuda-nvrtc-cu12` (no CuPy, no GPU, no driver), for
sm_61, sm_70, sm_75, sm_86 and sm_90, and fails if any PTX contains mma, wmma, wgmma, ldmatrix or
tcgen05 instructions (architecture.md, "GPU rules"). Exit status 0 = clean, 1 = tensor-core
instruction found, 2 = compile error or NVRTC missing. `--dump DIR` writes DIR/<arch>/<module>.ptx.

`--emit-ptx DIR --arch compute_61` (one architecture) writes a PTX directory that kernels/build.py
loads when MINECART_KERNEL_PTX=DIR: DIR/<module>.ptx for every module and DIR/kernels.json mapping each
name expression to its lowered symbol (build.py, "precompiled PTX directories"). The emitted set is
build.module_specs(), the list get_kernel compiles from, so a new module or instantiation is included
without a change here. The same tensor-core scan runs on the emitted PTX.

`--resources [REGEX]` compiles to machine code instead and prints each kernel's registers, stack and
spilled bytes as NVRTC 12's ptxas reports them (template names matching REGEX; every kernel takes
minutes), exit 1 if any spills: the one way to read them for sm_61 and sm_70, which CUDA 13's ptxas
dropped.

This checks the PTX that NVRTC emits; it is not a performance or correctness test.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .build import (
    BUILT_OPTIONS,
    PTX_MANIFEST,
    ModuleSpec,
    module_source,
    module_specs,
    source_digest,
    verify_ptx_dir,
)

ARCHS = ("sm_61", "sm_70", "sm_75", "sm_86", "sm_90")
FORBIDDEN = ("mma", "wmma", "wgmma", "ldmatrix", "tcgen05")
# An instruction line: optional predicate, then the opcode; the opcode's first dotted part is checked,
# so names like "gemma" in a symbol or comment never match.
_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)", re.M)
_INSTR = re.compile(r"^\s*(?:@!?%?\w+\s+)?([a-z_][a-z0-9_]*)(?:\.|\s|;)")


class NvrtcError(RuntimeError):
    pass


def _find_nvrtc() -> str:
    env = os.environ.get("MINECART_NVRTC")
    if env:
        return env
    cands: list[str] = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the PyPI wheel nvidia-cuda-nvrtc-cu12

        for base in pkg.__path__:
            cands += sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so.12*")))
            cands += sorted(glob.glob(os.path.join(base, "bin", "nvrtc64_12*.dll")))
    except ImportError:
        pass
    import ctypes.util

    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    if not cands:
        raise NvrtcError("NVRTC 12 not found: pip install nvidia-cuda-nvrtc-cu12 (or set MINECART_NVRTC "
                         "to the path of libnvrtc.so.12)")
    return cands[0]


class Nvrtc:
    """The handful of NVRTC entry points the guard needs."""

    def __init__(self, path: str | None = None):
        self.path = path or _find_nvrtc()
        self.lib = ctypes.CDLL(self.path)
        lib = self.lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.nvrtcAddNameExpression.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetPTXSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetPTX.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return major.value, minor.value

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise NvrtcError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile_ptx(self, source: str, name: str, arch: str, name_expressions=(), options=()) -> str:
        return self.compile_ptx_lowered(source, name, arch, name_expressions, options)[0]

    def compile_ptx_lowered(self, source: str, name: str, arch: str, name_expressions=(),
                            options=()) -> tuple[str, dict[str, str]]:
        """The PTX of `source` for `arch` (sm_XX or compute_XX), and each name expression's lowered
        (mangled) symbol, the name the PTX's .entry carries."""
        opts = [f"--gpu-architecture=compute_{arch.split('_')[1]}", *options]
        with self._compiled(source, name, arch, name_expressions, opts) as (prog, _):
            ptx = self._output(prog, self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX, "PTX")
            return ptx.rstrip(b"\0").decode(), self._lowered(prog, name_expressions)

    def compile_cubin(self, source: str, name: str, arch: str, name_expressions=(),
                      options=()) -> tuple[bytes, dict[str, str]]:
        """The machine code (cubin) of `source` for `arch` (sm_XX), and each name expression's lowered
        symbol (kernels/sass.py disassembles it)."""
        opts = [f"--gpu-architecture={arch.replace('compute_', 'sm_')}", *options]
        with self._compiled(source, name, arch, name_expressions, opts) as (prog, _):
            cubin = self._output(prog, self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN, "CUBIN")
            return cubin, self._lowered(prog, name_expressions)

    def _output(self, prog, get_size, get, kind: str) -> bytes:
        """A compiled program's PTX or CUBIN as bytes: get_size, then get (NVRTC's pair for `kind`)."""
        size = ctypes.c_size_t()
        self._ok(get_size(prog, ctypes.byref(size)), f"nvrtcGet{kind}Size")
        buf = ctypes.create_string_buffer(size.value)
        self._ok(get(prog, buf), f"nvrtcGet{kind}")
        return buf.raw[:size.value]

    def ptxas_info(self, source: str, name: str, arch: str, name_expressions=(),
                   options=()) -> tuple[str, dict[str, str]]:
        """ptxas's verbose report (registers, stack, spills, shared memory per kernel) of `source` compiled
        to machine code for `arch` (sm_XX), and each name expression's lowered symbol (the report's
        names)."""
        opts = [f"--gpu-architecture={arch.replace('compute_', 'sm_')}", "-Xptxas=-v", *options]
        with self._compiled(source, name, arch, name_expressions, opts) as (prog, log):
            return log, self._lowered(prog, name_expressions)

    def _lowered(self, prog, name_expressions) -> dict[str, str]:
        lowered: dict[str, str] = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            self._ok(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), f"lowered name of {expr}")
            lowered[expr] = (out.value or b"").decode()
        return lowered

    @contextlib.contextmanager
    def _compiled(self, source: str, name: str, arch: str, name_expressions, opts: list[str]):
        """A program of `source` compiled with `opts` (NvrtcError with its log if it does not compile),
        and its log; destroyed on leaving."""
        prog = ctypes.c_void_p()
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                             0, None, None), "nvrtcCreateProgram")
        try:
            for expr in name_expressions:
                self._ok(self.lib.nvrtcAddNameExpression(prog, expr.encode()), f"name expression {expr}")
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode(errors="replace")
            if rc != 0:
                raise NvrtcError(f"{name} for {arch} does not compile:\n{text}")
            yield prog, text
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@dataclass(frozen=True)
class KernelResources:
    symbol: str
    registers: int
    stack: int  # bytes of stack frame
    spill_stores: int
    spill_loads: int


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_info(log: str) -> list[KernelResources]:
    """The kernels of a ptxas verbose report, in its order."""
    out: list[KernelResources] = []
    symbol, frame = None, None
    for line in log.splitlines():
        if (m := _PTXAS_ENTRY.search(line)) is not None:
            symbol, frame = m.group(1), None
        elif (m := _PTXAS_FRAME.search(line)) is not None:
            frame = m
        elif (m := _PTXAS_REGS.search(line)) is not None and symbol is not None:
            st, ss, sl = (int(frame.group(i)) for i in (1, 2, 3)) if frame is not None else (0, 0, 0)
            out.append(KernelResources(symbol, int(m.group(1)), st, ss, sl))
            symbol = None
    return out


def resources(specs: list[ModuleSpec], archs, pattern: str = "", jobs: int = 2,
              sources: dict[str, str] | None = None, out=sys.stdout) -> int:
    """Print registers, stack and spills of every kernel (whose template name or symbol matches `pattern`)
    of `specs` for each architecture, as NVRTC 12's ptxas reports them; returns 1 if any of them spills."""
    nvrtc = Nvrtc()
    rx = re.compile(pattern) if pattern else None
    sources = sources or {}

    def one(item):
        spec, arch = item
        exprs = tuple(e for e in spec.name_expressions if rx is None or rx.search(e))
        plain = tuple(k for k in spec.extern_c if rx is None or rx.search(k))
        if not exprs and not plain:
            return spec, arch, {}, []
        src = sources.get(spec.name) or module_source(spec)
        log, lowered = nvrtc.ptxas_info(src, spec.name, arch, exprs, BUILT_OPTIONS)
        names = {sym: expr for expr, sym in lowered.items()} | {k: k for k in plain}
        rows = parse_ptxas_info(log)
        return spec, arch, names, [r for r in rows if r.symbol in names]

    status = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for fut in [pool.submit(one, (s, a)) for s in specs for a in archs]:
            spec, arch, names, rows = fut.result()
            for r in rows:
                spills = r.spill_stores + r.spill_loads
                status = max(status, 1 if spills else 0)
                print(f"{arch} {spec.name:<16} {names[r.symbol]:<36} {r.registers:4d} registers, "
                      f"{r.stack:4d} B stack, {r.spill_stores} / {r.spill_loads} B spilled (stores / loads)", file=out)
    print("no spills" if status == 0 else "SPILLS", file=out)
    return status


def tensor_core_lines(ptx: str) -> list[str]:
    """PTX instruction lines whose opcode is a tensor-core instruction."""
    bad = []
    for line in ptx.splitlines():
        s = line.split("//", 1)[0]
        m = _INSTR.match(s)
        if m and m.group(1) in FORBIDDEN:
            bad.append(line.strip())
    return bad


def check(specs: list[ModuleSpec] | None = None, archs=ARCHS, dump: Path | None = None, jobs: int = 2,
          sources: dict[str, str] | None = None, out=sys.stdout) -> int:
    """Compile and scan; returns the exit status. `sources` overrides a module's source (for tests)."""
    nvrtc = Nvrtc()
    specs = module_specs() if specs is None else specs
    sources = sources or {}
    jobs_list = [(s, a) for s in specs for a in archs]

    def one(item):
        spec, arch = item
        src = sources.get(spec.name) or module_source(spec)
        ptx = nvrtc.compile_ptx(src, spec.name, arch, spec.name_expressions, BUILT_OPTIONS)
        if dump is not None:
            d = Path(dump) / arch
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{spec.name}.ptx").write_text(ptx)
        return spec, arch, tensor_core_lines(ptx)

    status = 0
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))} ({nvrtc.path}); {len(specs)} modules x "
          f"{len(archs)} architectures", file=out)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(one, it) for it in jobs_list]
        for fut in futures:
            try:
                spec, arch, bad = fut.result()
            except NvrtcError as exc:
                print(f"COMPILE ERROR {exc}", file=out)
                status = max(status, 2)
                continue
            if bad:
                status = max(status, 1) if status != 2 else 2
                print(f"TENSOR CORE {spec.name} {arch}: {len(bad)} instruction(s), e.g. {bad[0]}", file=out)
            else:
                print(f"ok {spec.name:<16} {arch} ({len(spec.name_expressions)} instantiations)", file=out)
    print("PASS: no tensor-core instructions" if status == 0 else "FAIL", file=out)
    return status


def normalize_arch(arch: str) -> str:
    """'sm_61' or 'compute_61' -> 'sm_61' (one of ARCHS), else ValueError."""
    a = arch.strip().replace("compute_", "sm_")
    if a not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHS)} (or compute_XX)")
    return a


def ptx_entries(ptx: str) -> list[str]:
    """The kernel (.entry) symbols a PTX text defines."""
    return _ENTRY.findall(ptx)


def emit_ptx(directory: Path, arch: str, specs: list[ModuleSpec] | None = None, jobs: int = 2,
             out=sys.stdout) -> int:
    """Write the PTX directory of `arch` (see the module docstring); returns the exit status (0 ok,
    1 tensor-core instruction, 2 compile error or an unresolved kernel). Old *.ptx files in DIR go."""
    nvrtc = Nvrtc()
    sm = normalize_arch(arch)
    compute = sm.replace("sm_", "compute_")
    specs = module_specs() if specs is None else specs
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("*.ptx"), directory / PTX_MANIFEST]:
        old.unlink(missing_ok=True)

    def one(spec: ModuleSpec):
        src = module_source(spec)  # read once: the digest must describe the text compiled
        ptx, lowered = nvrtc.compile_ptx_lowered(src, spec.name, compute, spec.name_expressions,
                                                 BUILT_OPTIONS)
        (directory / f"{spec.name}.ptx").write_text(ptx)
        return spec, ptx, lowered, source_digest(spec, src)

    status = 0
    modules: dict[str, dict] = {}
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}: {len(specs)} modules as {compute} PTX -> {directory}",
          file=out)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for fut in [pool.submit(one, s) for s in specs]:
            try:
                spec, ptx, lowered, digest = fut.result()
            except NvrtcError as exc:
                print(f"COMPILE ERROR {exc}", file=out)
                status = 2
                continue
            if tensor_core_lines(ptx):
                status = max(status, 1)
                print(f"TENSOR CORE {spec.name} {compute}", file=out)
            modules[spec.name] = {"file": f"{spec.name}.ptx", "source_digest": digest,
                                  "names": lowered, "entries": ptx_entries(ptx)}
            print(f"ok {spec.name:<16} {compute} ({len(lowered)} instantiations, {len(ptx) >> 10} KiB)",
                  file=out)
    manifest = {"arch": compute, "nvrtc": ".".join(map(str, nvrtc.version())),
                "options": list(BUILT_OPTIONS), "modules": modules}
    (directory / PTX_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if status == 0:
        problems = verify_ptx_dir(directory, specs)
        for line in problems:
            print(f"UNRESOLVED {line}", file=out)
        status = 2 if problems else 0
    print("PASS: PTX directory complete" if status == 0 else "FAIL", file=out)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minecart.kernels.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append",
                   help="architecture to check, sm_XX or compute_XX among " + ", ".join(ARCHS)
                        + " (repeatable; default all)")
    p.add_argument("--module", action="append", help="only this module (repeatable; default all)")
    p.add_argument("--dump", type=Path, help="write each module's PTX to DIR/<arch>/<module>.ptx")
    p.add_argument("--emit-ptx", type=Path, metavar="DIR",
                   help="write a PTX directory for MINECART_KERNEL_PTX (every module and instantiation, "
                        "with the name map kernels.json) for the one --arch given")
    p.add_argument("--resources", metavar="REGEX", nargs="?", const="",
                   help="instead: registers, stack and spills of each kernel (template names matching REGEX, "
                        "default all) as ptxas reports them for each --arch; exit 1 if any spills")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compilations")
    a = p.parse_args(argv)
    try:
        archs = tuple(dict.fromkeys(normalize_arch(x) for x in (a.arch or ARCHS)))
    except ValueError as exc:
        p.error(str(exc))
    specs = module_specs()
    if a.module:
        specs = [s for s in specs if s.name in a.module]
    try:
        if a.resources is not None:
            return resources(specs, archs, a.resources, a.jobs)
        if a.emit_ptx is not None:
            if len(archs) != 1:
                p.error("--emit-ptx needs exactly one --arch (e.g. --arch compute_61)")
            return emit_ptx(a.emit_ptx, archs[0], specs, a.jobs)
        return check(specs, archs, a.dump, a.jobs)
    except NvrtcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
