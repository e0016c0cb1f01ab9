"""Where a kernel's instructions go, read from its machine code on a machine without a GPU.

    python -m minecart.kernels.sass --module matmul_Q4_K --kernel "gemm_batch<12, 8>" [--arch sm_90] [--top 12]

Compiles one module of build.module_specs() to machine code for one architecture with NVRTC 12 (the
wheel kernels/check.py uses), disassembles it with `nvdisasm` and prints, for the whole
kernel and for each loop (a backward branch and the instructions from its target to it), how many
instructions it issues, how many of them are DP4A (`IDP.4A`), fp32 math, shared and global memory
accesses, barriers and shuffles, and the most common opcodes (registers: `check --resources`).

What it tells and what it does not: the instruction mix of a loop body sets a floor on the body's time
(each warp instruction takes an issue slot of its scheduler, a DP4A two slots of the integer pipe: half
rate); against the time a profiler measures it says whether a kernel is held by what it issues or by
waiting (latency, occupancy, memory). It counts static instructions, so a loop body with branches
inside is counted as if every path ran. docs/kernels.md shows it used on gemm_batch.

nvdisasm comes from $NVDISASM, the PATH, or the PyPI wheel `nvidia-cuda-nvdisasm` (in the `test`
extra). CUDA 13's nvdisasm reads sm_75 and later; for sm_61 / sm_70 use `check --resources`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .build import BUILT_OPTIONS, module_source, module_specs

# nvdisasm -c: a function starts at its symbol's label line, branch targets are local labels
# (".L_x_12:" before the instruction they name), and an instruction is
#   /*addr*/ [@[!]P|UP pred] OPCODE operands ;
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FUNCTION = re.compile(r"^([A-Za-z_$][\w$]*):\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")

# opcode classes (the opcode's first dotted part)
CLASSES = (
    ("dp4a", ("IDP",)),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FCHK", "MUFU")),
    ("shared", ("LDS", "STS")),
    ("global", ("LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED", "LDC")),
    ("barrier", ("BAR", "SYNCS", "MEMBAR")),
    ("shuffle", ("SHFL",)),
    ("move", ("MOV", "UMOV", "IMAD.MOV", "S2R", "S2UR", "CS2R")),
)


# Tensor-core opcodes of the machine code (first dotted part): the PTX scan of kernels/check.py seen
# from the other side. HFMA2.MMA is not one (an fp16 FMA the compiler also uses to load constants).
TENSOR_CORE_OPS = frozenset({"HMMA", "IMMA", "BMMA", "DMMA", "QMMA", "OMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA",
                             "LDSM", "UTCHMMA", "UTCIMMA", "UTCQMMA", "UTCOMMA"})


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str
    operands: str
    target: int | None = None  # a branch's target address


@dataclass(frozen=True)
class Loop:
    start: int  # the branch's target
    end: int  # the backward branch's own address

    def body(self, instrs: list[Instr]) -> list[Instr]:
        return [i for i in instrs if self.start <= i.addr <= self.end]


def parse(sass: str) -> dict[str, list[Instr]]:
    """nvdisasm -c text -> the instructions of each function (by its symbol), in address order, each
    branch with its target's address."""
    raw: dict[str, list[tuple[int, str, str]]] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    current: list[tuple[int, str, str]] | None = None
    for line in sass.splitlines():
        f = _FUNCTION.match(line)
        if f:
            current = raw.setdefault(f.group(1), [])
            continue
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.match(line)
        if m and current is not None:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            current.append((addr, m.group(2), m.group(3).strip()))
    out: dict[str, list[Instr]] = {}
    for name, items in raw.items():
        out[name] = []
        for addr, op, operands in items:
            t = _TARGET.search(operands)
            out[name].append(Instr(addr, op, operands, labels.get(t.group(1)) if t else None))
    return out


def loops(instrs: list[Instr]) -> list[Loop]:
    """Every backward branch (BRA to a lower address) as a loop, outermost (longest) first."""
    found = [Loop(i.target, i.addr) for i in instrs
             if i.opcode.split(".")[0] == "BRA" and i.target is not None and i.target < i.addr]
    return sorted(found, key=lambda lp: (lp.start - lp.end, lp.start))


def tensor_core(instrs: list[Instr]) -> list[Instr]:
    """The instructions among `instrs` that run on tensor cores (TENSOR_CORE_OPS)."""
    return [i for i in instrs if i.opcode.split(".")[0] in TENSOR_CORE_OPS]


def op_class(opcode: str) -> str:
    for name, prefixes in CLASSES:
        for p in prefixes:
            if opcode == p or opcode.startswith(p + "."):
                return name
    return "other"


def mix(instrs: list[Instr]) -> Counter[str]:
    """Instructions by class (CLASSES, else "other"), with "total"."""
    c: Counter[str] = Counter(op_class(i.opcode) for i in instrs)
    c["total"] = len(instrs)
    return c


def find_nvdisasm() -> str | None:
    """$NVDISASM, nvdisasm on the PATH, or the one of the nvidia-cuda-nvdisasm wheel; None without."""
    env = os.environ.get("NVDISASM")
    if env:
        return env
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in sys.path:
        p = Path(base) / "nvidia" / "cu13" / "bin" / "nvdisasm"
        if p.is_file():
            return str(p)
    return None


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    with tempfile.TemporaryDirectory(prefix="minecart-sass-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"nvdisasm failed ({res.returncode}): {res.stderr.strip()[:400]}")
        return res.stdout


def module_sass(module: str, kernels: list[str], arch: str = "sm_90",
                nvdisasm: str | None = None) -> dict[str, list[Instr]]:
    """The instructions of each of `kernels` (name expressions of `module`, or its extern "C" kernels'
    names) for `arch`, compiled as the engine compiles them (BUILT_OPTIONS): one compile and one
    disassembly for all of them."""
    from .check import Nvrtc

    spec = next((s for s in module_specs() if s.name == module), None)
    if spec is None:
        raise ValueError(f"no module {module!r}; modules: {', '.join(s.name for s in module_specs())}")
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise RuntimeError("no nvdisasm: pip install nvidia-cuda-nvdisasm, or set $NVDISASM")
    unknown = [k for k in kernels if k not in spec.name_expressions and k not in spec.extern_c]
    if unknown:
        raise ValueError(f"{module} has no kernel {unknown[0]!r}; it has: "
                         f"{', '.join(spec.name_expressions + spec.extern_c)}")
    exprs = tuple(k for k in kernels if k in spec.name_expressions)
    cubin, lowered = Nvrtc().compile_cubin(module_source(spec), spec.name, arch, exprs, BUILT_OPTIONS)
    functions = parse(disassemble(cubin, tool))
    out: dict[str, list[Instr]] = {}
    for k in kernels:
        symbol = lowered.get(k, k)
        if symbol not in functions:
            raise RuntimeError(f"{symbol} not in the disassembly ({len(functions)} functions)")
        out[k] = functions[symbol]
    return out


def _row(label: str, c: Counter[str]) -> str:
    per = f"{(c['total'] - c['dp4a']) / c['dp4a']:.2f}" if c["dp4a"] else "-"
    cols = " ".join(f"{c[name]:6d}" for name, _ in CLASSES)
    return f"{label:<24s}{c['total']:7d} {cols} {c['other']:6d} {per:>9s}"


def report(instrs: list[Instr], top: int = 12, out=None) -> None:
    out = out if out is not None else sys.stdout
    head = " ".join(f"{name:>6s}" for name, _ in CLASSES)
    print(f"{'':<24s}{'instrs':>7s} {head} {'other':>6s} {'others/dp4a':>9s}", file=out)
    print(_row("whole kernel", mix(instrs)), file=out)
    for lp in loops(instrs):
        body = lp.body(instrs)
        print(_row(f"loop {lp.start:#06x}-{lp.end:#06x}", mix(body)), file=out)
        common = Counter(i.opcode for i in body).most_common(top)
        print("    " + ", ".join(f"{op} {n}" for op, n in common), file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minecart.kernels.sass", description=__doc__.split("\n\n")[1])
    p.add_argument("--module", required=True, help="a module of kernels/build.py (e.g. matmul_Q4_K)")
    p.add_argument("--kernel", required=True, help='a kernel of it, as build.py names it (e.g. "gemm_batch<12, 8>")')
    p.add_argument("--arch", default="sm_90", help="sm_75, sm_86 or sm_90 (default sm_90)")
    p.add_argument("--top", type=int, default=12, help="most common opcodes listed per loop (default 12)")
    a = p.parse_args(argv)
    try:
        instrs = module_sass(a.module, [a.kernel], a.arch)[a.kernel]
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{a.kernel} ({a.module}, {a.arch}): {len(instrs)} instructions", file=sys.stdout)
    report(instrs, a.top)
    bad = tensor_core(instrs)
    if bad:
        print(f"TENSOR CORE: {', '.join(sorted({i.opcode for i in bad}))}", file=sys.stdout)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
