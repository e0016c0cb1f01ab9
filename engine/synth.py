"""Synthetic models: GGUF files with random weights but the real shapes and metadata of a named model.

What this is: a way to get a 9B or 35B-A3B file (or a tiny one) for benchmarks, placement and loader
tests without downloading anything. `write_synthetic(path, "qwen3.5-9b", "q8_0")` streams a GGUF to
disk tensor by tensor, generating random quantization blocks directly (no float32 matrix is ever
built for a quantized tensor), so a 9.5 GB file costs about as long as the disk takes to write it.

The values are sane, so a model runs on them without overflow, following the recipe of the shared
fixture: linear weights have std 0.7/sqrt(fan_in) (0.3 for projections that write into the residual
stream), norms are 1 + N(0, 0.2^2) (GGUF stores RMSNorm weights with the +1 applied), `ssm_a` is
-exp(U) with exp(U) log-uniform in [0.02, 4], `ssm_dt.bias` N(0, 1), conv taps N(0, 0.5^2). Small tensors
stay F32 as the converter keeps them. The tokenizer is a byte-level `gpt2` vocabulary of exactly
`vocab_size` entries: the 256 byte tokens, filler tokens `<|synth_N|>` (UNUSED), and the real Qwen
special tokens at their real ids; no merges, so text encodes byte by byte.

What this is not: a model that says anything. Outputs are noise; only shapes, speed and numerics matter.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import quants as Q
from .errors import RequestError
from .models import qwen35
from .quant_mix import Mix, file_type, matrix_types, parse_quant

# The named shapes live with the architecture (engine/models/qwen35.py); synth writes files of them.
SynthShape = qwen35.Shape
SHAPES: dict[str, SynthShape] = qwen35.SHAPES


# Qwen3.5/3.6 added tokens at their real ids (docs/qwen35.md, "Tokens"); type 3 CONTROL, 4 USER_DEFINED
SPECIAL_TOKENS = {
    248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>",
    248047: "<|object_ref_start|>", 248048: "<|object_ref_end|>", 248049: "<|box_start|>",
    248050: "<|box_end|>", 248051: "<|quad_start|>", 248052: "<|quad_end|>", 248053: "<|vision_start|>",
    248054: "<|vision_end|>", 248055: "<|vision_pad|>", 248056: "<|image_pad|>", 248057: "<|video_pad|>",
    248058: "<tool_call>", 248059: "</tool_call>", 248060: "<|fim_prefix|>", 248061: "<|fim_middle|>",
    248062: "<|fim_suffix|>", 248063: "<|fim_pad|>", 248064: "<|repo_name|>", 248065: "<|file_sep|>",
    248066: "<tool_response>", 248067: "</tool_response>", 248068: "<think>", 248069: "</think>",
    248070: "<|audio_start|>", 248071: "<|audio_end|>", 248072: "<tts_pad>", 248073: "<tts_text_bos>",
    248074: "<tts_text_eod>", 248075: "<tts_text_bos_single>", 248076: "<|audio_pad|>",
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
EOS_ID, PAD_ID = 248046, 248044

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------------
# GGUF encoding (little-endian, version 3)

_VT = {"UINT8": 0, "INT8": 1, "UINT16": 2, "INT16": 3, "UINT32": 4, "INT32": 5, "FLOAT32": 6, "BOOL": 7,
       "STRING": 8, "ARRAY": 9, "UINT64": 10, "INT64": 11, "FLOAT64": 12}
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
       11: "<i8", 12: "<f8"}


def _gguf_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def encode_kv(key: str, vtype: str, value, elem_type: str | None = None) -> bytes:
    """One metadata entry. vtype is a GGUF type name; arrays give `elem_type` (not nested)."""
    t = _VT[vtype]
    out = _gguf_string(key) + struct.pack("<I", t)
    if t == _VT["STRING"]:
        return out + _gguf_string(value)
    if t != _VT["ARRAY"]:
        return out + struct.pack(_SCALAR_FMT[t], value)
    if elem_type is None:
        raise ValueError(f"{key}: an ARRAY entry needs elem_type")
    et = _VT[elem_type]
    out += struct.pack("<IQ", et, len(value))
    if et == _VT["STRING"]:
        return out + b"".join(_gguf_string(s) for s in value)
    return out + np.asarray(value).astype(_NP[et]).tobytes()


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: logical row-major shape, GGML type, and how to fill it."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    init: str  # "linear", "embed", "norm", "conv", "ssm_a", "normal"
    std: float = 1.0

    @property
    def row_bytes(self) -> int:
        return Q.bytes_per_row(self.type_id, self.shape[-1])

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def n_bytes(self) -> int:
        return self.n_rows * self.row_bytes


def write_gguf(path: str | Path, kvs: list[bytes], tensors: list[PlannedTensor],
               chunks: Callable[[PlannedTensor], Iterator[np.ndarray]], alignment: int = 32,
               progress: Callable[[int, int], None] | None = None) -> int:
    """Stream a GGUF v3 file: header, metadata, tensor infos, then each tensor's bytes as `chunks`
    yields them (uint8 arrays, in order, exactly n_bytes in total). Returns the file size."""
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += -(-t.n_bytes // alignment) * alignment
    total_data = pos
    head = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs)), *kvs]
    for t, off in zip(tensors, offsets, strict=True):
        ne = tuple(reversed(t.shape))
        head.append(_gguf_string(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type_id, off))
    header = b"".join(head)
    header += b"\0" * (-len(header) % alignment)
    # A writer thread overlaps the disk with the generator (file writes release the GIL); the bounded
    # queue keeps at most a few chunks in memory.
    pending: queue.Queue = queue.Queue(maxsize=3)
    failure: list[BaseException] = []

    def writer(f) -> None:
        while (item := pending.get()) is not None:
            if not failure:
                try:
                    f.write(item)
                except BaseException as exc:  # reported by the producer below
                    failure.append(exc)

    done = 0
    with open(path, "wb") as f:
        f.write(header)
        thread = threading.Thread(target=writer, args=(f,), name="gguf-writer", daemon=True)
        thread.start()
        try:
            for t in tensors:
                written = 0
                for chunk in chunks(t):
                    if failure:
                        raise failure[0]
                    pending.put(np.ascontiguousarray(chunk).data.cast("B"))
                    written += chunk.nbytes
                if written != t.n_bytes:
                    raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.n_bytes}")
                pending.put(b"\0" * (-written % alignment))
                done += written
                if progress:
                    progress(done, total_data)
        finally:
            pending.put(None)
            thread.join()
        if failure:
            raise failure[0]
    return len(header) + total_data


# ---------------------------------------------------------------------------------------------------
# random values


def _random_quant_blocks(rng: np.random.Generator, type_id: int, n: int, std: float) -> np.ndarray:
    """n blocks of GGML type `type_id` whose values have mean ~0 and standard deviation ~std.

    The quantized payload is uniform random bits (the fastest thing numpy can make). The scale fields
    are then overwritten with entries of a 256-row table of jittered (+-25%) scales, picked by a random
    byte of each block, so neighbouring blocks differ (a kernel that applies the wrong block's scale
    fails a test) without generating floats per block. The tables make the uniform integers map to
    zero-mean values with the wanted spread.
    """
    bv, bb = Q.BLOCK_SIZES[type_id]
    words = rng.bit_generator.random_raw(-(-n * bb // 8))
    blocks = words.view(np.uint8)[: n * bb].reshape(n, bb)
    jitter = np.linspace(0.75, 1.25, 256, dtype=np.float32)
    rng.shuffle(jitter)
    pick = blocks[:, bb - 1] if type_id != Q.Q6_K else blocks[:, 0]  # a random payload byte per block

    def put(col: int, table: np.ndarray) -> None:
        table = np.ascontiguousarray(table)
        width = table.shape[1]
        blocks[:, col : col + width] = table[pick]

    def f16(x: np.ndarray) -> np.ndarray:
        return x.astype("<f2").reshape(-1, 1).view(np.uint8)

    if type_id == Q.Q8_0:  # int8 uniform on [-128, 127]: std 73.9
        put(0, f16(jitter * (std / 73.9)))
    elif type_id == Q.Q4_0:  # q - 8 uniform on [-8, 7]: std 4.61
        put(0, f16(jitter * (std / 4.61)))
    elif type_id == Q.Q5_0:  # q - 16 uniform on [-16, 15]: std 9.23
        put(0, f16(jitter * (std / 9.23)))
    elif type_id in (Q.Q4_1, Q.Q5_1):  # x = d*q + m with m = -d * mean(q)
        spread, mean = (4.61, 7.5) if type_id == Q.Q4_1 else (9.23, 15.5)
        d = (jitter * (std / spread)).astype(np.float16).astype(np.float32)
        put(0, np.concatenate([f16(d), f16(-mean * d)], axis=1))
    elif type_id in (Q.Q4_K, Q.Q5_K):  # x = d*sc*q - dmin*m with m = sc and dmin = d * mean(q)
        spread, mean = (4.61, 7.5) if type_id == Q.Q4_K else (9.23, 15.5)
        sc = rng.integers(32, 64, (256, 8), dtype=np.uint8)
        d = (jitter * (std / (spread * 47.5))).astype(np.float16).astype(np.float32)
        put(0, np.concatenate([f16(d), f16(mean * d), Q.pack_k_scales_mins(sc, sc)], axis=1))
    elif type_id == Q.Q6_K:  # x = d*sc*(q-32): q - 32 uniform on [-32, 31] (std 18.5), sc in [64, 127]
        blocks[:, 192:208] = (blocks[:, 192:208] >> np.uint8(2)) | np.uint8(64)
        put(208, f16(jitter * (std / (18.5 * 95.5))))
    elif type_id in (Q.IQ4_NL, Q.IQ4_XS):  # levels (rms 67.4); IQ4_XS: times ls - 32 on [-32, 31] (rms 18.5)
        sign = np.where(np.arange(256) % 2 == 0, 1.0, -1.0).astype(np.float32)  # levels are not zero-mean
        rms = 67.4 if type_id == Q.IQ4_NL else 67.4 * 18.5
        put(0, f16(sign * jitter * (std / rms)))
    else:
        raise ValueError(f"no random block generator for {Q.type_name(type_id)}")
    return blocks


_POOL = 1 << 20


def _normal(rng: np.random.Generator, n: int) -> np.ndarray:
    """n standard normal float32 values. Large requests are stitched from randomly rotated copies of
    one pool of 2^20 draws: the Gaussian generator is the bottleneck of big F16 files, and weights of
    a synthetic model need only look random, not be independent across megabytes."""
    if n <= 2 * _POOL:
        return rng.standard_normal(n, dtype=np.float32)
    pool = rng.standard_normal(_POOL, dtype=np.float32)
    doubled = np.concatenate([pool, pool])
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, _POOL):
        k = min(_POOL, n - start)
        o = int(rng.integers(0, _POOL))
        out[start : start + k] = doubled[o : o + k] if rng.random() < 0.5 else -doubled[o : o + k]
    return out


def _float_values(rng, t: PlannedTensor, n: int) -> np.ndarray:
    if t.init == "norm":  # RMSNorm weights as stored in GGUF (1 + w)
        return 1.0 + 0.2 * rng.standard_normal(n, dtype=np.float32)
    if t.init == "ssm_a":  # -exp(A_log), exp(A_log) log-uniform in [0.02, 4]
        return -np.exp(rng.uniform(np.log(0.02), np.log(4.0), n)).astype(np.float32)
    x = _normal(rng, n)
    x *= np.float32(t.std)
    return x


_CHUNK_BYTES = 64 << 20


def _tensor_chunks(rng: np.random.Generator, t: PlannedTensor) -> Iterator[np.ndarray]:
    rows_per_chunk = max(1, _CHUNK_BYTES // max(t.row_bytes, 1))
    for start in range(0, t.n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, t.n_rows - start)
        n_values = rows * t.shape[-1]
        if t.type_id in (Q.F32, Q.F16, Q.BF16):
            x = _float_values(rng, t, n_values)
            if t.type_id == Q.F32:
                yield x.astype("<f4").view(np.uint8)
            elif t.type_id == Q.F16:
                yield x.astype("<f2").view(np.uint8)
            else:  # bfloat16: the upper half of the float32 (truncation is fine for random values)
                yield (x.astype("<f4").view("<u4") >> 16).astype("<u2").view(np.uint8)
        else:
            bv, _ = Q.BLOCK_SIZES[t.type_id]
            yield _random_quant_blocks(rng, t.type_id, n_values // bv, t.std).reshape(-1)


# ---------------------------------------------------------------------------------------------------
# the model plan


def plan_tensors(shape: SynthShape, quant: int | Mix, *, fuse_gate_up: bool = False) -> list[PlannedTensor]:
    """Every tensor of the model in converter order, with its GGML type and initialisation, as the
    architecture's spec lists them (engine/models/qwen35.py SPEC). quant: one type for every matrix, or
    a llama-quantize mix (engine/quant_mix.py)."""
    config = shape.config()
    options = frozenset({qwen35.FUSED_GATE_UP}) if fuse_gate_up else frozenset()
    specs = [(name, t, t.shape(config)) for name, t in qwen35.SPEC.plan(config, options)]
    types = matrix_types([(name, dims[-1]) for name, t, dims in specs if not t.f32],
                         shape.n_layers + shape.n_mtp, quant)
    out: list[PlannedTensor] = []
    for name, t, dims in specs:
        std = t.fill.std
        if t.fill.per_fan_in:
            std = min(t.fill.cap, std / np.sqrt(dims[-1]))
        out.append(PlannedTensor(name, dims, Q.F32 if t.f32 else types[name], t.fill.init, std))
    return out


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table in its id order: printable bytes first, then the rest."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]


def tokenizer_kvs(vocab_size: int) -> list[bytes]:
    tokens = _byte_tokens()
    types = [TOKEN_NORMAL] * len(tokens)
    specials = {i: t for i, t in SPECIAL_TOKENS.items() if i < vocab_size}
    for i in range(len(tokens), vocab_size):
        if i in specials:
            name = specials[i]
            tokens.append(name)
            types.append(TOKEN_CONTROL if name.startswith("<|") or name.startswith("<tts_") else TOKEN_USER_DEFINED)
        else:
            tokens.append(f"<|synth_{i}|>")
            types.append(TOKEN_UNUSED)
    return [
        encode_kv("tokenizer.ggml.model", "STRING", "gpt2"),
        encode_kv("tokenizer.ggml.pre", "STRING", "qwen35"),
        encode_kv("tokenizer.ggml.tokens", "ARRAY", tokens, "STRING"),
        encode_kv("tokenizer.ggml.token_type", "ARRAY", types, "INT32"),
        encode_kv("tokenizer.ggml.merges", "ARRAY", [], "STRING"),
        encode_kv("tokenizer.ggml.eos_token_id", "UINT32", EOS_ID),
        encode_kv("tokenizer.ggml.padding_token_id", "UINT32", PAD_ID),
        encode_kv("tokenizer.ggml.add_bos_token", "BOOL", False),
        encode_kv("tokenizer.chat_template", "STRING", CHAT_TEMPLATE),
    ]


def model_kvs(shape: SynthShape, quant: int | Mix, seed: int) -> list[bytes]:
    s, a = shape, shape.arch
    block_count = s.n_layers + s.n_mtp
    recurrent = [i < s.n_layers and (i + 1) % s.full_attention_interval != 0 for i in range(block_count)]
    kv = [
        encode_kv("general.architecture", "STRING", a),
        encode_kv("general.type", "STRING", "model"),
        encode_kv("general.name", "STRING", f"synthetic {s.display}"),
        encode_kv("general.description", "STRING",
                  f"random weights with the shape of {s.display}, written by `minecart synth` (seed {seed})"),
        encode_kv("general.file_type", "UINT32", file_type(quant)),
        encode_kv("general.quantization_version", "UINT32", 2),
        encode_kv("general.alignment", "UINT32", 32),
        encode_kv(f"{a}.block_count", "UINT32", block_count),
        encode_kv(f"{a}.context_length", "UINT32", s.context_length),
        encode_kv(f"{a}.embedding_length", "UINT32", s.hidden),
        encode_kv(f"{a}.attention.head_count", "UINT32", s.n_heads),
        encode_kv(f"{a}.attention.head_count_kv", "UINT32", s.n_kv_heads),
        encode_kv(f"{a}.rope.dimension_sections", "ARRAY", list(s.rope_sections), "INT32"),
        encode_kv(f"{a}.rope.freq_base", "FLOAT32", s.rope_base),
        encode_kv(f"{a}.attention.layer_norm_rms_epsilon", "FLOAT32", s.rms_eps),
        encode_kv(f"{a}.attention.key_length", "UINT32", s.head_dim),
        encode_kv(f"{a}.attention.value_length", "UINT32", s.head_dim),
        encode_kv(f"{a}.ssm.conv_kernel", "UINT32", s.conv_kernel),
        encode_kv(f"{a}.ssm.state_size", "UINT32", s.gdn_head_dim),
        encode_kv(f"{a}.ssm.group_count", "UINT32", s.gdn_k_heads),
        encode_kv(f"{a}.ssm.time_step_rank", "UINT32", s.gdn_v_heads),
        encode_kv(f"{a}.ssm.inner_size", "UINT32", s.gdn_v_heads * s.gdn_head_dim),
        encode_kv(f"{a}.attention.recurrent_layers", "ARRAY", recurrent, "BOOL"),
        encode_kv(f"{a}.full_attention_interval", "UINT32", s.full_attention_interval),
        encode_kv(f"{a}.rope.dimension_count", "UINT32", s.rope_dims),
    ]
    if s.n_mtp:
        kv.append(encode_kv(f"{a}.nextn_predict_layers", "UINT32", s.n_mtp))
    if s.n_experts:
        kv += [
            encode_kv(f"{a}.expert_count", "UINT32", s.n_experts),
            encode_kv(f"{a}.expert_used_count", "UINT32", s.n_experts_used),
            encode_kv(f"{a}.expert_feed_forward_length", "UINT32", s.expert_ffn),
            encode_kv(f"{a}.expert_shared_feed_forward_length", "UINT32", s.shared_expert_ffn),
        ]
    else:
        kv.append(encode_kv(f"{a}.feed_forward_length", "UINT32", s.ffn))
    return kv + tokenizer_kvs(s.vocab_size)


def resolve(shape: str | SynthShape, quant: str | int | Mix) -> tuple[SynthShape, int | Mix]:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise RequestError(f"unknown shape '{shape}'; choose one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if shape.vocab_size < 256:
        raise RequestError(f"vocab_size {shape.vocab_size} is below the 256 byte-level tokens")
    return shape, parse_quant(quant)


def write_synthetic(path: str | Path, shape: str | SynthShape, quant: str | int | Mix = "q8_0", seed: int = 0,
                    n_layers: int | None = None, *, mtp: bool = True, fuse_gate_up: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """Write a synthetic GGUF; returns {"path", "bytes", "seconds", "mb_per_s", "tensors"}.

    n_layers keeps only the first N main layers (the MTP block, if any, follows them).
    """
    shape, kind = resolve(shape, quant)
    if n_layers is not None and n_layers < 0:
        raise RequestError(f"--layers must be >= 0, got {n_layers}")
    shape = shape.truncated(n_layers, mtp)
    t0 = time.perf_counter()
    rng = np.random.Generator(np.random.SFC64(seed))  # the fastest raw bits numpy ships
    tensors = plan_tensors(shape, kind, fuse_gate_up=fuse_gate_up)
    size = write_gguf(path, model_kvs(shape, kind, seed), tensors, lambda t: _tensor_chunks(rng, t),
                      progress=progress)
    seconds = time.perf_counter() - t0
    return {"path": str(path), "bytes": size, "seconds": seconds,
            "mb_per_s": size / 1e6 / max(seconds, 1e-9), "tensors": len(tensors)}
