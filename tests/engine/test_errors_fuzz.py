"""Fuzz: corrupt the headers of real GGUF files (random byte changes in the first few KB, truncations
at random lengths). Opening, reading the config and checking the tensors must either work or raise a
MinecartError: never hang, never another exception type, never crash the interpreter.

About 200 cases, weighted toward small files so the whole test stays well under 30 s on two cores
(opening a file with a 248k-token vocabulary costs ~0.3 s; the small ones cost milliseconds).
"""

from __future__ import annotations

import dataclasses
import shutil
import time

import numpy as np
import pytest
from minecart.engine.config import ModelConfig, validate_tensors
from minecart.engine.errors import MinecartError
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.quants import SUPPORTED_TYPES, dequantize

# (file, mutation cases, truncation cases)
PLAN = [
    ("vision/mmproj-qwen35-tiny-vl-f32.gguf", 45, 15),
    ("vision/mmproj-qwen35-tiny-vl-f16.gguf", 20, 10),
    ("synthetic", 55, 20),
    ("dense/qwen35-tiny-dense-q8_0.gguf", 6, 4),
    ("dense/qwen35-tiny-dense-f16.gguf", 4, 3),
    ("qwen35-vocab.gguf", 3, 3),
    ("vision/qwen35-tiny-vl-f16.gguf", 3, 3),
]
HEADER_BYTES = 4096
# byte values that make absurd lengths, counts and type ids likely
SPECIAL = np.array([0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF], dtype=np.uint8)


def exercise(path) -> str:
    """Everything a loader does before computing; returns 'ok' or the error class name."""
    try:
        with GGUFFile(path) as gf:
            for info in list(gf.tensors.values())[:40]:
                np.asarray(info.raw).sum()  # touch the mapped bytes
                if info.ggml_type in SUPPORTED_TYPES and info.n_bytes < 1 << 20:
                    dequantize(info, gf.path)
            if gf.get("general.architecture") in ("qwen35", "qwen35moe", "gemma3"):
                config = ModelConfig.from_gguf(gf)
                if gf.tensors:
                    validate_tensors(config, gf)
        return "ok"
    except MinecartError as exc:
        assert str(path) in str(exc), exc  # every message names the file
        return type(exc).__name__


@pytest.fixture(scope="module")
def sources(fixtures_dir, tmp_path_factory):
    from minecart.engine.synth import SHAPES, write_synthetic

    d = tmp_path_factory.mktemp("fuzz_src")
    out = {}
    for rel, _, _ in PLAN:
        if rel == "synthetic":  # a small-vocabulary MoE file: tensor infos sit inside the first KB
            p = d / "synthetic.gguf"
            write_synthetic(p, dataclasses.replace(SHAPES["tiny-moe"], vocab_size=256), "q4_k", n_layers=2)
        else:
            p = fixtures_dir / rel
        out[rel] = p
    return out


@pytest.mark.timeout(120)
def test_fuzz_headers(sources, tmp_path):
    rng = np.random.default_rng(20261130)
    outcomes: dict[str, int] = {}
    slowest = (0.0, "")
    n_cases = 0
    t_start = time.perf_counter()
    for rel, n_mut, n_cut in PLAN:
        src = sources[rel]
        original = src.read_bytes()
        size = len(original)
        work = tmp_path / "work.gguf"
        shutil.copyfile(src, work)
        assert exercise(work) == "ok"  # the untouched file is fine
        cases = [("mut", i) for i in range(n_mut)] + [("cut", i) for i in range(n_cut)]
        for kind, i in cases:
            if kind == "mut":
                n = int(rng.integers(1, 9))
                pos = rng.integers(0, min(HEADER_BYTES, size), n)
                vals = np.where(rng.random(n) < 0.5, rng.choice(SPECIAL, n), rng.integers(0, 256, n)).astype(np.uint8)
                with open(work, "r+b") as f:
                    for p, v in zip(pos.tolist(), vals.tolist(), strict=True):
                        f.seek(p)
                        f.write(bytes([v]))
                target, label = work, f"{rel} mut{i} at {pos.tolist()}"
            else:
                # half the cuts inside the header region, half anywhere in the file
                limit = min(HEADER_BYTES * 4, size) if i % 2 == 0 else size
                length = int(rng.integers(0, limit))
                target = tmp_path / f"cut{i}.gguf"
                target.write_bytes(original[:length])
                label = f"{rel} cut at {length}"
            t0 = time.perf_counter()
            result = exercise(target)
            dt = time.perf_counter() - t0
            slowest = max(slowest, (dt, label))
            outcomes[result] = outcomes.get(result, 0) + 1
            n_cases += 1
            if kind == "mut":  # restore the original bytes
                with open(work, "r+b") as f:
                    for p in pos.tolist():
                        f.seek(p)
                        f.write(original[p : p + 1])
            else:
                target.unlink()
    total = time.perf_counter() - t_start
    print(f"\nfuzz: {n_cases} cases in {total:.1f} s, outcomes {outcomes}, slowest {slowest[0]:.2f} s ({slowest[1]})")
    assert n_cases >= 190
    assert outcomes.get("ok", 0) < n_cases  # the mutations do break files
    assert len(outcomes) >= 3  # and in more than one way
    assert slowest[0] < 10  # nothing hangs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["tiny-dense", "tiny-moe"])
def test_fuzz_metadata_values(tmp_path, shape):
    """Every model key set to a wrong value, type or an absurd value (3, 0, -1, 2**40, a string, a list, missing):
    building the config and checking the tensors raises MinecartError naming the file, or works.
    block_count = 2**40 must not build a trillion-entry layer list."""
    from minecart.engine.synth import SHAPES, write_synthetic

    p = tmp_path / "m.gguf"
    write_synthetic(p, dataclasses.replace(SHAPES[shape], vocab_size=300), "q8_0", n_layers=4)
    gf = GGUFFile(p)
    original = dict(gf.metadata)
    keys = [k for k in original if k.startswith(("qwen35", "general.architecture", "tokenizer.ggml.tokens"))]
    assert len(keys) > 20
    outcomes: dict[str, int] = {}
    for key in keys:
        for value in (0, 3, -1, 2**40, "abc", [], [1, 2], 1.5, True, ["x"] * 5, None):
            gf.metadata = dict(original)
            if value is None:
                del gf.metadata[key]
            else:
                gf.metadata[key] = value
            try:
                validate_tensors(ModelConfig.from_gguf(gf), gf)
                result = "ok"
            except MinecartError as exc:
                assert str(p) in str(exc)
                result = type(exc).__name__
            outcomes[result] = outcomes.get(result, 0) + 1
    assert outcomes.get("ok", 0) < sum(outcomes.values()) / 2
    assert {"GGUFError", "MissingKeyError", "ShapeMismatchError"} <= set(outcomes)
