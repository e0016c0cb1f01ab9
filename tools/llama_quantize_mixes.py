"""Write tests/data/llama_quantize_mixes.json: the tensor types llama.cpp's own `llama-quantize` gives
small synthetic models in its Q4_K_M and Q5_K_M mixes, the reference engine/synth.py's `Mix` is
checked against (tests/engine/test_synth_mixes.py).

    python tools/llama_quantize_mixes.py --llama-quantize /tmp/lq/bin/llama-quantize

Each case is a `minecart synth` F16 file of a small shape (every row a whole number of 256-value
blocks, or not, where said) quantized by llama-quantize; the JSON holds, per case, the shape's fields
and, per mix, every tensor's type as the quantized file records it (read back with
engine/gguf_file.py).
llama-quantize comes from llama.cpp's source (the tree `../shared/tools/llama-peer` fetches), built
for the CPU: `cmake -S SRC -B /tmp/lq -DGGML_CUDA=OFF -DGGML_NATIVE=OFF && cmake --build /tmp/lq
--target llama-quantize`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from minecart.engine.gguf_file import GGUFFile
from minecart.engine.synth import SHAPES, write_synthetic

ROOT = Path(__file__).resolve().parents[1]

MIXES = ("Q4_K_M", "Q5_K_M")


def cases() -> dict:
    """name -> the synth shape quantized."""
    base = dataclasses.replace(SHAPES["small-dense"], vocab_size=512)
    return {
        "small-dense-32-tied": dataclasses.replace(base, n_layers=32),
        "small-dense-24-untied": dataclasses.replace(base, n_layers=24, tied=False),
        # 16 experts: llama-quantize has rules of its own for exactly 8 (Mixtral's attention in Q8_0 / Q5_K)
        "small-moe-16": dataclasses.replace(base, n_layers=16, tied=False, ffn=0, n_experts=16, n_experts_used=2,
                                            expert_ffn=256, shared_expert_ffn=256),
        "tiny-dense-8": dataclasses.replace(SHAPES["tiny-dense"], vocab_size=512),  # 32-wide rows: fallbacks
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-quantize", required=True, help="the llama-quantize binary")
    p.add_argument("--source", default="llama-cpp-python 0.3.36's llama.cpp (../shared/tools/llama-peer)",
                   help="where the llama-quantize binary was built from (recorded in the JSON)")
    p.add_argument("--out", default=str(ROOT / "tests" / "data" / "llama_quantize_mixes.json"))
    args = p.parse_args()
    out: dict = {"made_by": f"tools/llama_quantize_mixes.py with llama-quantize built from {args.source}",
                 "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in cases().items():
            out["cases"][name] = {"shape": dataclasses.asdict(shape)}
            src = Path(tmp) / f"{name}-f16.gguf"
            write_synthetic(src, shape, "f16", seed=1)
            for mix in MIXES:
                dst = Path(tmp) / f"{name}-{mix}.gguf"
                run = subprocess.run([args.llama_quantize, str(src), str(dst), mix, "1"], capture_output=True,
                                     text=True)
                if run.returncode != 0:
                    print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
                    return 1
                gf = GGUFFile(dst)
                out["cases"][name][mix] = {t: gf.tensor(t).type_name for t in gf.tensors}
                dst.unlink()
            print(name, "done", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
