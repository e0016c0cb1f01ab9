"""Images per second of a vision tower: `python -m minecart.engine.vision.bench`.

    python -m minecart.engine.vision.bench --tower qwen3.5-27b --device cuda:0 --tokens 256 1024
    python -m minecart.engine.vision.bench --mmproj mmproj-F16.gguf --device cpu --tokens 64

Writes a synthetic mmproj of the named tower (engine/vision/synth_mmproj.py) unless one is given, loads it
on the device, and times the encoder (preprocessing excluded: the pixels are made once) on square random
images of about the given token counts. With --check, the device's embeddings are compared with the NumPy
backend's (max abs difference / max abs value). What this is not: a model benchmark (bench_cmd.py).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np


def _image(tokens: int, seed: int):
    from PIL import Image

    side = 32 * max(1, round(math.sqrt(tokens)))
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def run(mmproj, device: str, token_counts, repeats: int = 3, check: bool = False) -> list[dict]:
    from ..execution import make_backend
    from .mmproj import load_vision

    tower = load_vision(mmproj, backend=make_backend(device), max_image_tokens=max(token_counts))
    reference = load_vision(mmproj) if check and tower.backend.name != "numpy" else None
    rows = []
    for n in token_counts:
        pre = tower.preprocess(_image(n, n), max_image_tokens=n)
        emb = tower.encode_pixels(pre)  # warm-up (kernels, cuBLAS handles)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tower.encode_pixels(pre)
            times.append(time.perf_counter() - t0)
        best = min(times)
        row = {"tokens": pre.n_tokens, "patches": pre.pixel_values.shape[0], "seconds": best,
               "images_per_s": 1.0 / best, "tokens_per_s": pre.n_tokens / best}
        if reference is not None:
            ref = reference.encode_pixels(pre)
            row["rel_err_vs_numpy"] = float(np.abs(emb - ref).max() / np.abs(ref).max())
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tower", default="qwen3.5-27b", help="synthetic tower shape (engine/vision/synth_mmproj.py)")
    p.add_argument("--quant", default="f16", help="synthetic tower's matrix type: f32, f16, bf16, q8_0")
    p.add_argument("--mmproj", default=None, help="an existing mmproj GGUF instead of a synthetic one")
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="image tokens per image")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per size (the best is kept)")
    p.add_argument("--check", action="store_true", help="compare with the NumPy backend")
    args = p.parse_args(argv)
    path = args.mmproj
    if path is None:
        from .synth_mmproj import write_synthetic_mmproj

        path = str(Path(tempfile.gettempdir()) / f"mmproj-synth-{args.tower}-{args.quant}.gguf")
        if not Path(path).is_file():
            write_synthetic_mmproj(path, args.tower, args.quant)
    for row in run(path, args.device, args.tokens, args.repeats, args.check):
        extra = f", rel err vs NumPy {row['rel_err_vs_numpy']:.2e}" if "rel_err_vs_numpy" in row else ""
        print(f"{Path(path).name} on {args.device}: {row['tokens']} tokens ({row['patches']} patches) "
              f"{row['seconds'] * 1000:.1f} ms = {row['images_per_s']:.2f} images/s, "
              f"{row['tokens_per_s']:.0f} tokens/s{extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
