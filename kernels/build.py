"""Which CUDA modules exist, what each instantiates, and compiling them with cupy.RawModule.

A module is common.cuh plus one or more .cu files, textually joined (NVRTC gets no include path), with
template instantiations named through `name_expressions`. Compiled modules are cached in-process per
(module, compute capability); CuPy also caches the binaries on disk keyed by source and options, so a
second start does not recompile. `module_specs()` is also what kernels/check.py compiles for every
architecture, so the guard sees exactly what runs.

Not here: launch geometry (ops.py) and the tensor-core guard (check.py). Imports cupy lazily so that
check.py can use the specs on a machine without CuPy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# GGML type ids (the template argument QT of the kernels).
QT = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30}
DP4A_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
HFMA2_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")  # formats with an fp16 HFMA2 kernel (hfma2.cu)
GEMV_TOKENS = (1, 2, 4, 8)  # tokens per GEMV launch; other counts are split into these
# (warps per row, L2 prefetch) of the gemv_dp4a_split instantiations (single-token launches)
GEMV_SPLIT = ((1, 0), (2, 0), (4, 0), (1, 1), (2, 1))
GEMM_STAGE_BLOCKS = (1, 2)  # quant blocks per shared-memory stage of gemm_dp4a (the probe picks)
HEAD_DIMS = (64, 128, 256)  # attention head dims compiled
GDN_KEY_DIMS = (16, 32, 64, 128)  # Gated DeltaNet key dims compiled
GDN_CHUNK_KEY_DIMS = (32, 64, 128)  # key dims of the chunked GDN prefill kernels (multiples of 32)
KV_CACHE_TYPES = ("f16", "q8_0")  # KV caches attention.cu reads directly (modules attention_<type>)
KVQ3_KERNELS = ("quantize", "dequant", "rotate", "unrotate", "decode", "flash_decode")  # kvq3.cu templates, one per head dim

COMPILE_OPTIONS = ("-std=c++17",)


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
        names += [f"gemm_dp4a<{q}, {nb}>" for nb in GEMM_STAGE_BLOCKS]
    names += [f"embed_rows<{q}>"]
    return ModuleSpec(f"matmul_{type_name}", ("gemv.cu", "gemm.cu", "embed.cu"), tuple(names))


def module_specs() -> list[ModuleSpec]:
    """Every module the engine can load, with every template instantiation it can ask for."""
    specs = [_matmul_spec(t) for t in QT]
    specs.append(ModuleSpec("quantize", ("quantize.cu",), (), ("quantize_q8_1",)))
    norms = [f"row_norm<{w}, {m}>" for w in ("true", "false") for m in range(4)]
    ew = [f"ewise<{op}>" for op in range(8)]
    specs.append(ModuleSpec("elementwise", ("elementwise.cu",), tuple(norms + ew), ("gdn_gates", "rope_neox")))
    att = [f"flash_prefill{v}<{d}>" for v in ("", "_g") for d in HEAD_DIMS]
    att += [f"flash_decode<{d}>" for d in HEAD_DIMS]
    specs.append(ModuleSpec("attention", ("attention.cu",), tuple(att),
                            ("flash_merge", "flash_merge_len", "kv_append")))
    # the same prefill/decode kernels over f16 and q8_0 caches (kv_f16.cu / kv_q8_0.cu define the loads)
    typed = tuple(f"flash_prefill_g<{d}>" for d in HEAD_DIMS) + tuple(f"flash_decode<{d}>" for d in HEAD_DIMS)
    for kv in KV_CACHE_TYPES:
        specs.append(ModuleSpec(f"attention_{kv}", (f"kv_{kv}.cu", "attention.cu"), typed,
                                (f"kv_append_{kv}",)))
    gdn = [f"gdn_scan<{d}>" for d in GDN_KEY_DIMS]
    gdn += [f"gdn_chunk_{p}<{d}>" for p in ("prep", "state") for d in GDN_CHUNK_KEY_DIMS]
    specs.append(ModuleSpec("gdn", ("gdn.cu",), tuple(gdn),
                            ("conv1d_silu", "conv_state_update")))
    # fused single-token decode kernels (fused.py)
    specs.append(ModuleSpec("fused", ("fused.cu",),
                            ("rms_norm_q8<0>", "rms_norm_q8<1>") + tuple(f"gdn_decode<{d}>" for d in GDN_KEY_DIMS),
                            ("swiglu_q8", "attn_prep", "attn_merge_gate")))
    specs.append(ModuleSpec("sampling", ("sampling.cu",), (),
                            ("topk_stage1", "topk_stage2", "moe_route", "moe_combine")))
    specs.append(ModuleSpec("bench", ("bench.cu",), (), ("copy_f4", "peak_dp4a", "peak_fma")))
    for t in HFMA2_TYPES:  # fp16 HFMA2 matmuls (hfma2.py), one module per weight format
        hf = [f"gemv_hfma2<{QT[t]}, {nt}>" for nt in GEMV_TOKENS] + [f"gemm_hfma2<{QT[t]}>"]
        specs.append(ModuleSpec(f"hfma2_{t}", ("gemv.cu", "hfma2.cu"), tuple(hf), ("quantize_h16",)))
    # q3 KV cache (kvq3.py; CupyQ3KVCache in engine/backends/cupy_backend.py)
    specs.append(ModuleSpec("kvq3", ("kvq3.cu",), tuple(f"kvq3_{k}<{d}>" for k in KVQ3_KERNELS for d in HEAD_DIMS)))
    return specs


def module_source(spec: ModuleSpec) -> str:
    parts = [(HERE / "common.cuh").read_text()]
    for f in spec.files:
        parts.append(f"// ---- {f} ----\n" + (HERE / f).read_text())
    return "\n".join(parts)


_SPECS = {s.name: s for s in module_specs()}
_cache: dict[tuple[str, int], object] = {}
_lock = threading.Lock()


def get_module(name: str):
    """The compiled cupy.RawModule `name` for the current device (compiled once per capability)."""
    import cupy as cp

    dev = cp.cuda.Device()
    key = (name, int(dev.compute_capability))
    mod = _cache.get(key)
    if mod is None:
        with _lock:
            mod = _cache.get(key)
            if mod is None:
                spec = _SPECS[name]
                mod = cp.RawModule(code=module_source(spec), options=COMPILE_OPTIONS,
                                   name_expressions=list(spec.name_expressions) or None)
                _cache[key] = mod
    return mod


def get_kernel(module: str, name: str):
    return get_module(module).get_function(name)
