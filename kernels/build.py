"""Which CUDA modules exist, what each instantiates, and compiling them with cupy.RawModule.

A module is common.cuh plus one or more .cu files, textually joined (NVRTC gets no include path), with
template instantiations named through `name_expressions`. Compiled modules are cached in-process per
(module, compute capability); CuPy also caches the binaries on disk keyed by source and options, so a
second start does not recompile. `module_specs()` is also what kernels/check.py compiles for every
architecture, so the guard sees exactly what runs. With MINECART_KERNEL_PTX=DIR the modules are loaded
from PTX that check.py emitted instead (compute_61 / compute_70 on a newer card: "precompiled PTX
directories" at the end of this file).

Not here: launch geometry (ops.py) and the tensor-core guard (check.py). Imports cupy lazily so that
check.py can use the specs on a machine without CuPy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kquant_layout import KQUANT_TYPES
from .launch import capturing, launch_pdl, pdl_wanted

HERE = Path(__file__).resolve().parent

# GGML type ids (the template argument QT of the kernels).
QT = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30,
      "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "IQ4_NL": 20, "IQ4_XS": 23,
      "Q5_K": 13}
DP4A_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q5_K")
# (warps per row, blocks per lane in flight) of gemv_kq, the single-token GEMV of the K-quants
# (KQUANT_TYPES, repacked at upload by kquant_layout.py); ops._gemv_kq / MINECART_GEMV_KQ pick one
GEMV_KQ = ((1, 2), (1, 4), (2, 4), (4, 4), (1, 8), (2, 8))
# blocks per lane a round of gemv_kq_stream<QT, NU> (the same GEMV, each warp streaming rows with the next
# round's loads in flight); ops._gemv_kq / MINECART_GEMV_KQ = "sN" pick one
GEMV_KQ_STREAM = (2, 4)
# -- multi-token K-quant GEMV (gemv_kq_mt, batched decode) --
# (warps per row, super-blocks per lane in flight) of gemv_kq_mt<QT, NT, WPR, NU>, compiled for every NT in
# GEMV_KQ_MT_TOKENS; ops._gemv_kq_mt / MINECART_GEMV_KQ_MT pick one
GEMV_KQ_MT = ((2, 2), (4, 2), (2, 4), (4, 4))
GEMV_KQ_MT_TOKENS = (2, 3, 4, 5, 6, 7, 8)  # also the token counts of gemv_mt
# gemv_mt<QT, NT, WPR, NU>: gemv_kq_mt's geometry for these other DP4A formats, (WPR, NU) compiled below;
# ops._gemv_mt / MINECART_GEMV_MT pick one
GEMV_MT_TYPES = ("Q8_0",)
GEMV_MT = ((2, 1), (4, 1), (2, 2), (4, 2))


def kq_passes(T: int) -> list[tuple[int, int]]:
    """(first token, tokens) of the gemv_kq_mt / gemv_mt launches of T >= 2 tokens (ops.matmul): ceil(T / 8)
    passes of near-equal size (T = 9: 5 + 4; never one token, which they are not compiled for)."""
    if T < 2:
        raise ValueError(f"gemv_kq_mt runs 2 or more tokens, got {T}")
    n = -(-T // max(GEMV_KQ_MT_TOKENS))
    sizes = [T // n + (1 if i < T % n else 0) for i in range(n)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(n)]


HFMA2_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")  # formats with an fp16 HFMA2 kernel (hfma2.cu)
GEMV_TOKENS = (1, 2, 4, 8)  # tokens per GEMV launch; other counts are split into these
# (warps per row, L2 prefetch) of the gemv_dp4a_split instantiations (single-token launches)
GEMV_SPLIT = ((1, 0), (2, 0), (4, 0), (1, 1), (2, 1))
GEMV_STREAM = (1, 2)  # blocks per lane a round of gemv_dp4a_stream<QT, NU> (ops.GEMV_VARIANT "streamN")
GEMM_STAGE_BLOCKS = (1, 2)  # quant blocks per shared-memory stage of gemm_dp4a (the probe picks)
GEMM_BATCH_TOKENS = (8, 16, 32)  # token tiles of gemm_batch (batched decode: T <= 32 sequences)
HEAD_DIMS = (64, 128, 256)  # attention head dims compiled
DECODE_GROUPS = (2, 4, 8)  # flash_decode<D, GM>: query heads per KV head up to GM (ops.decode_group)
GDN_KEY_DIMS = (16, 32, 64, 128)  # Gated DeltaNet key dims compiled
GDN_CHUNK_KEY_DIMS = (32, 64, 128)  # key dims of the chunked GDN prefill kernels (multiples of 32)
KV_CACHE_TYPES = ("f16", "q8_0")  # KV caches attention.cu reads directly (modules attention_<type>)
# kvq3.cu templates, each for every head dim {d}: quantize for K (3-bit) and V (2-bit) codes
KVQ3_KERNELS = ("quantize<{d}, 3>", "quantize<{d}, 2>", "rotate<{d}>", "unrotate<{d}>", "flash_decode<{d}>",
                "prefill<{d}>")

COMPILE_OPTIONS = ("-std=c++17",)
# What the engine's kernels are built with in the end: CuPy's compile adds -ftz=true after the caller's
# options (cupy/cuda/compiler.py), so fp32 subnormals flush to zero in every kernel it builds (a block of
# subnormal activations quantizes to zeros). The offline builds that stand for the engine's (the PTX of
# MINECART_KERNEL_PTX, `check --resources`, kernels/sass.py) compile with these, so they compile what
# the engine runs.
BUILT_OPTIONS = (*COMPILE_OPTIONS, "-ftz=true")


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    files: tuple[str, ...]
    name_expressions: tuple[str, ...] = ()
    extern_c: tuple[str, ...] = field(default=())  # plain extern "C" kernels (for documentation/tests)


def _matmul_spec(type_name: str) -> ModuleSpec:
    q = QT[type_name]
    names = [f"gemv_fma<{q}, {nt}>" for nt in GEMV_TOKENS] + [f"gemm_fma<{q}>"]
    if type_name in DP4A_TYPES:
        names += [f"gemv_dp4a<{q}, {nt}>" for nt in GEMV_TOKENS]
        names += [f"gemv_dp4a_split<{q}, 1, {wpr}, {pf}>" for wpr, pf in GEMV_SPLIT]
        names += [f"gemv_dp4a_stream<{q}, {nu}>" for nu in GEMV_STREAM]
        names += [f"gemm_dp4a<{q}, {nb}>" for nb in GEMM_STAGE_BLOCKS]
        if type_name != "Q8_0":
            names += [f"requant_q8_0<{q}>"]
        else:  # the gate and up rows of a feed-forward layer with SwiGLU in the epilogue (ops.matmul_swiglu)
            names += [f"gemm_dp4a<{q}, 2, true>"]
        names += [f"gemm_batch<{q}, {tt}>" for tt in GEMM_BATCH_TOKENS]
    if type_name in KQUANT_TYPES:
        names += [f"gemv_kq<{q}, {wpr}, {nu}>" for wpr, nu in GEMV_KQ]
        names += [f"gemv_kq_stream<{q}, {nu}>" for nu in GEMV_KQ_STREAM]
        names += [f"gemv_kq_mt<{q}, {nt}, {wpr}, {nu}>" for nt in GEMV_KQ_MT_TOKENS for wpr, nu in GEMV_KQ_MT]
    if type_name in GEMV_MT_TYPES:
        names += [f"gemv_mt<{q}, {nt}, {wpr}, {nu}>" for nt in GEMV_KQ_MT_TOKENS for wpr, nu in GEMV_MT]
    names += [f"embed_rows<{q}>"]
    return ModuleSpec(f"matmul_{type_name}", ("gemv.cu", "gemm.cu", "embed.cu"), tuple(names), ("splitk_sum",))


def module_specs() -> list[ModuleSpec]:
    """Every module the engine can load, with every template instantiation it can ask for."""
    specs = [_matmul_spec(t) for t in QT]
    specs.append(ModuleSpec("quantize", ("quantize.cu",), (), ("quantize_q8_1",)))
    norms = [f"row_norm<{w}, {m}>" for w in ("true", "false") for m in range(4)]
    ew = [f"ewise<{op}>" for op in range(8)]
    specs.append(ModuleSpec("elementwise", ("elementwise.cu",), tuple(norms + ew),
                            ("gdn_gates", "rope_neox", "split_cols")))
    att = [f"flash_prefill{v}<{d}>" for v in ("", "_g") for d in HEAD_DIMS]
    att += [f"flash_decode{v}<{d}, {g}>" for v in ("", "_batch") for d in HEAD_DIMS for g in DECODE_GROUPS]
    specs.append(ModuleSpec("attention", ("attention.cu", "attn_prep.cu"), tuple(att),
                            ("flash_merge", "flash_merge_len", "kv_append", "attn_prep", "attn_prep_batch")))
    # the same prefill/decode kernels over f16 and q8_0 caches (kv_f16.cu / kv_q8_0.cu define the loads)
    typed = tuple(f"flash_prefill_g<{d}>" for d in HEAD_DIMS) + tuple(f"flash_decode{v}<{d}, {g}>" for v in ("", "_batch") for d in HEAD_DIMS for g in DECODE_GROUPS)
    for kv in KV_CACHE_TYPES:
        specs.append(ModuleSpec(f"attention_{kv}", (f"kv_{kv}.cu", "attention.cu", "attn_prep.cu"), typed,
                                (f"kv_append_{kv}", "attn_prep", "attn_prep_batch")))
    gdn = [f"gdn_scan<{d}>" for d in GDN_KEY_DIMS]
    gdn += [f"gdn_chunk_{p}<{d}>" for p in ("prep", "state") for d in GDN_CHUNK_KEY_DIMS]
    specs.append(ModuleSpec("gdn", ("gdn.cu",), tuple(gdn),
                            ("conv1d_silu", "conv_state_update")))
    # fused single-token decode kernels (fused.py)
    specs.append(ModuleSpec("fused", ("fused.cu",),
                            ("rms_norm_q8<0>", "rms_norm_q8<1>")
                            + tuple(f"gdn_decode{v}<{d}>" for v in ("", "_batch") for d in GDN_KEY_DIMS),
                            ("swiglu_q8", "attn_merge_gate", "attn_merge_gate_batch")))
    specs.append(ModuleSpec("sampling", ("sampling.cu",), (),
                            ("topk_stage1", "topk_stage2", "topk_group_max", "topk_threshold", "topk_gather", "topk_select",
                             "penalize", "pick_top",
                             "moe_route", "moe_combine")))
    specs.append(ModuleSpec("bench", ("bench.cu",), (), ("copy_f4", "peak_dp4a", "peak_fma")))
    specs.append(ModuleSpec("link", ("link.cu",), (), ("link_hold",)))  # simulated links (link.py)
    specs.append(ModuleSpec("expert_call", ("expert_call.cu",), (), ("expert_call",)))  # expert_call.py
    # -- MoE (moe.py): one module per expert format (gate and up of one format) --
    for t in DP4A_TYPES:
        q = QT[t]
        moe = [f"moe_gemm_dp4a<{q}, {nb}>" for nb in GEMM_STAGE_BLOCKS]
        moe += [f"moe_gate_up_q8<{q}, {q}>", f"moe_down_sum<{q}>"]
        moe += [f"moe_dec_router<{q}>", f"moe_dec_gate_up<{q}, {q}>", f"moe_dec_down<{q}>"]  # decode block
        specs.append(ModuleSpec(f"moe_{t}", ("gemv.cu", "moe.cu"), tuple(moe), ("moe_sort", "moe_swiglu_q8")))
    # -- end MoE --
    for t in HFMA2_TYPES:  # fp16 HFMA2 matmuls (hfma2.py), one module per weight format
        hf = [f"gemv_hfma2<{QT[t]}, {nt}>" for nt in GEMV_TOKENS] + [f"gemm_hfma2<{QT[t]}>"]
        specs.append(ModuleSpec(f"hfma2_{t}", ("gemv.cu", "hfma2.cu"), tuple(hf), ("quantize_h16",)))
    # q3 KV cache (kvq3.py; CupyQ3KVCache in engine/backends/cupy_backend.py)
    specs.append(ModuleSpec("kvq3", ("kvq3.cu",), tuple("kvq3_" + k.format(d=d) for k in KVQ3_KERNELS for d in HEAD_DIMS)))
    return specs


def module_source(spec: ModuleSpec) -> str:
    parts = [(HERE / "common.cuh").read_text()]
    for f in spec.files:
        parts.append(f"// ---- {f} ----\n" + (HERE / f).read_text())
    return "\n".join(parts)


_SPECS = {s.name: s for s in module_specs()}
_cache: dict[tuple[str, int, str], object] = {}
_lock = threading.Lock()


def get_module(name: str):
    """The compiled cupy.RawModule `name` for the current device (compiled once per capability), or,
    when MINECART_KERNEL_PTX names a PTX directory, the module loaded from that directory's PTX."""
    import cupy as cp

    dev = cp.cuda.Device()
    ptx = ptx_dir()
    key = (name, int(dev.compute_capability), str(ptx or ""))
    mod = _cache.get(key)
    if mod is None:
        with _lock:
            mod = _cache.get(key)
            if mod is None:
                spec = _SPECS[name]
                if ptx is not None:
                    mod = PtxModule(ptx, spec)
                else:
                    mod = cp.RawModule(code=module_source(spec), options=COMPILE_OPTIONS,
                                       name_expressions=list(spec.name_expressions) or None)
                _cache[key] = mod
    return mod


class Kernel:
    """A compiled kernel of a module: `kernel(grid, block, args, shared_mem=0)` launches it on the current
    stream, as a CuPy RawKernel call does; into a CUDA graph being captured, with programmatic dependent
    launch where the card has it (kernels/launch.py)."""

    __slots__ = ("fn", "pdl")

    def __init__(self, fn: Any, pdl: bool):
        self.fn = fn
        self.pdl = pdl

    def __call__(self, grid: Any, block: Any, args: tuple, shared_mem: int = 0) -> None:
        if self.pdl:
            stream = _current_stream_ptr()
            if stream != 0 and capturing(stream):
                launch_pdl(self.fn.kernel.ptr, grid, block, args, shared_mem)
                return
        self.fn(grid, block, args, shared_mem=shared_mem)

    @property
    def num_regs(self) -> int:  # registers a thread (ptxas)
        return int(self.fn.num_regs)

    @property
    def local_size_bytes(self) -> int:  # local memory a thread: spills
        return int(self.fn.local_size_bytes)

    @property
    def ptx_version(self) -> int:  # the virtual architecture of the code the driver loaded
        return int(self.fn.ptx_version)


_kernels: dict[tuple[str, str, int, str], Kernel] = {}


def _current_stream_ptr() -> int:
    import cupy as cp

    return int(cp.cuda.get_current_stream().ptr)


def get_kernel(module: str, name: str) -> Kernel:
    import cupy as cp

    cc = int(cp.cuda.Device().compute_capability)
    ptx = ptx_dir()
    key = (module, name, cc, str(ptx or ""))
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = Kernel(get_module(module).get_function(name), launches_with_pdl(cc, ptx))
    return k


def launches_with_pdl(cc: int, ptx: Path | None) -> bool:
    """Whether kernels run on a card of compute capability `cc` from `ptx` (a PTX directory, None for
    the compiled sources) launch with PDL. Code from a PTX directory is the architecture it was emitted
    for: compute_61 PTX has no wait in pdl_entry, so it must not start early, whatever card runs it."""
    return pdl_wanted(cc if ptx is None else min(cc, _ptx_arch(ptx)))


@functools.lru_cache(maxsize=8)
def _ptx_arch(directory: Path) -> int:
    """The compute capability a PTX directory was emitted for (its manifest's arch, e.g. compute_61 -> 61)."""
    arch = str(read_ptx_manifest(directory).get("arch", ""))
    try:
        return int(arch.split("_")[1])
    except (IndexError, ValueError):
        raise KernelPtxError(f"{directory / PTX_MANIFEST}: arch {arch!r} is not compute_XX") from None


# ---- precompiled PTX directories (MINECART_KERNEL_PTX) ----------------------------------------------
# `python -m minecart.kernels.check --emit-ptx DIR --arch compute_61` writes DIR/<module>.ptx for every
# module above and DIR/kernels.json (PTX_MANIFEST): the architecture, and per module its PTX file, a
# digest of the source it was built from, the lowered (mangled) symbol of every name expression and the
# PTX's .entry symbols. With MINECART_KERNEL_PTX=DIR, get_kernel loads the modules from that PTX
# (cupy.RawModule(path=...); the driver JIT-compiles it for the card) instead of compiling the sources:
# this is how the compute_61 / compute_70 code paths run on a GPU whose NVRTC cannot target them.
PTX_ENV = "MINECART_KERNEL_PTX"
PTX_MANIFEST = "kernels.json"
_EXTERN_C = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)')


class KernelPtxError(RuntimeError):
    """A PTX directory (MINECART_KERNEL_PTX) lacks a module or kernel, or was built from other sources."""


def extern_c_kernels(spec: ModuleSpec) -> tuple[str, ...]:
    """The extern "C" kernels of a module: those its sources define, plus any its spec lists."""
    found = _EXTERN_C.findall(module_source(spec))
    return tuple(dict.fromkeys([*found, *spec.extern_c]))


def kernel_requests(specs: list[ModuleSpec] | None = None) -> list[tuple[str, str]]:
    """(module, kernel name) for every kernel get_kernel can be asked for: each module's template
    instantiations (name expressions) and its extern "C" kernels."""
    out: list[tuple[str, str]] = []
    for spec in module_specs() if specs is None else specs:
        out += [(spec.name, n) for n in (*spec.name_expressions, *extern_c_kernels(spec))]
    return out


def source_digest(spec: ModuleSpec, source: str | None = None) -> str:
    """What a module's PTX depends on: its joined source (`source`, else read now), name expressions
    and compile options."""
    h = hashlib.sha256((module_source(spec) if source is None else source).encode())
    for part in (*spec.name_expressions, "\0", *BUILT_OPTIONS):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def ptx_dir() -> Path | None:
    """The PTX directory named by MINECART_KERNEL_PTX, or None (compile the sources, the default).
    Read at every get_kernel call, so it stays a dictionary look-up."""
    return _resolved_dir(os.environ.get(PTX_ENV, ""))


@functools.lru_cache(maxsize=8)
def _resolved_dir(env: str) -> Path | None:
    return Path(env.strip()).resolve() if env.strip() else None


def read_ptx_manifest(directory: Path) -> dict[str, Any]:
    """DIR/kernels.json, or a KernelPtxError that says how to make it."""
    path = Path(directory) / PTX_MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KernelPtxError(f"{PTX_ENV}={directory}: cannot read {path} ({exc}); build the directory with "
                             f"`python -m minecart.kernels.check --emit-ptx {directory} --arch compute_61`") from exc
    if not isinstance(data, dict) or not isinstance(data.get("modules"), dict):
        raise KernelPtxError(f"{path} is not a kernel PTX manifest (no 'modules' object)")
    return data


def _rebuild_hint(directory: Path, manifest: dict[str, Any]) -> str:
    return (f"rebuild it: `python -m minecart.kernels.check --emit-ptx {directory} --arch "
            f"{manifest.get('arch', 'compute_61')}` (or `python tools/make_ptx.py`)")


def _ptx_module_entry(directory: Path, module: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's record of `module`, checked against this tree's sources."""
    entry = manifest["modules"].get(module)
    if entry is None:
        raise KernelPtxError(f"kernel module {module!r} is not in the PTX directory {directory} ({PTX_ENV}); "
                             + _rebuild_hint(directory, manifest))
    spec = _SPECS.get(module)
    if spec is not None and entry.get("source_digest") != source_digest(spec):
        raise KernelPtxError(f"the PTX of kernel module {module!r} in {directory} ({PTX_ENV}) was built from "
                             "other sources than this tree's; " + _rebuild_hint(directory, manifest))
    return entry


def _ptx_entry_symbol(directory: Path, module: str, name: str, entry: dict[str, Any],
                      manifest: dict[str, Any]) -> str:
    symbol = entry.get("names", {}).get(name)
    if symbol is None and name in entry.get("entries", ()):
        symbol = name  # an extern "C" kernel: its symbol is its name
    if symbol is None:
        raise KernelPtxError(f"kernel {name!r} of module {module!r} is not in the PTX directory {directory} "
                             f"({PTX_ENV}); " + _rebuild_hint(directory, manifest))
    return str(symbol)


def ptx_symbol(directory: Path, module: str, name: str,
               manifest: dict[str, Any] | None = None) -> tuple[Path, str]:
    """(PTX file, symbol) of kernel `name` (a name expression or an extern "C" name) of `module` in a PTX
    directory; a KernelPtxError names what is missing or stale and how to rebuild."""
    data = read_ptx_manifest(directory) if manifest is None else manifest
    entry = _ptx_module_entry(directory, module, data)
    return Path(directory) / entry["file"], _ptx_entry_symbol(directory, module, name, entry, data)


def verify_ptx_dir(directory: Path, specs: list[ModuleSpec] | None = None) -> list[str]:
    """Every problem a PTX directory has for this tree (a missing module, file or kernel, stale
    sources), one line each; [] when every kernel get_kernel can ask for resolves. Needs no GPU."""
    try:
        data = read_ptx_manifest(directory)
    except KernelPtxError as exc:
        return [str(exc)]
    problems: list[str] = []
    for spec in module_specs() if specs is None else specs:
        try:
            entry = _ptx_module_entry(directory, spec.name, data)
        except KernelPtxError as exc:
            problems.append(str(exc))
            continue
        path = Path(directory) / entry["file"]
        if not path.is_file():
            problems.append(f"{path} is missing (listed in {Path(directory) / PTX_MANIFEST})")
        for module, name in kernel_requests([spec]):
            try:
                _ptx_entry_symbol(directory, module, name, entry, data)
            except KernelPtxError as exc:
                problems.append(str(exc))
    return problems


def kernel_build_tag() -> str:
    """'' for kernels compiled from source here, 'ptx-compute_61' (the PTX directory's architecture)
    when they come from MINECART_KERNEL_PTX: keeps per-card timings of the two builds apart."""
    d = ptx_dir()
    if d is None:
        return ""
    return f"ptx-{read_ptx_manifest(d).get('arch', 'unknown')}"


class PtxModule:
    """A module loaded from a PTX directory: get_function takes the same names as a RawModule compiled
    with name_expressions (a name expression or an extern "C" name) and maps them to PTX symbols. The
    manifest and the source digest are checked once, here; a lookup is a dictionary access."""

    def __init__(self, directory: Path, spec: ModuleSpec):
        import cupy as cp

        self.directory = Path(directory)
        self.module = spec.name
        self.manifest = read_ptx_manifest(self.directory)
        self.entry = _ptx_module_entry(self.directory, spec.name, self.manifest)
        path = self.directory / self.entry["file"]
        if not path.is_file():
            raise KernelPtxError(f"{path} is missing (listed in {self.directory / PTX_MANIFEST})")
        self.raw = cp.RawModule(path=str(path))

    def get_function(self, name: str):
        return self.raw.get_function(_ptx_entry_symbol(self.directory, self.module, name, self.entry,
                                                       self.manifest))
