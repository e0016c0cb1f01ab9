"""`python -m minecart.engine.kv_report MODEL [--kv-type T]`: a KV cache type (q3 by default) against the
exact f32 cache on a model (NumPy backend).

Prints kvquant.measure's report as JSON: per sequence the logit agreement and greedy agreement of the
two cache types, and the bytes per token per layer of every type. A command over a loaded model, so it sits
above engine/model.py; the format and the measurements themselves are engine/kvquant.py's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from .backends.numpy_backend import NumpyBackend
from .kvquant import KV_TYPES, measure
from .model import load_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minecart.engine.kv_report",
                                description="Compare a KV cache type with f32 on a model (NumPy backend).")
    p.add_argument("model", help="GGUF file")
    p.add_argument("--sequences", default=None, metavar="JSON",
                   help="a sequences.json like the shared fixtures' (default: random ids, seed 0)")
    p.add_argument("--lengths", default="16,64,256", help="random sequence lengths when no --sequences")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens to compare after each sequence")
    p.add_argument("--kv-type", default="q3", choices=[t for t in KV_TYPES if t != "f32"],
                   help="the cache type to compare with f32 (default q3)")
    args = p.parse_args(argv)
    model = load_model(args.model, backend=NumpyBackend(), mmproj=False)
    if args.sequences:
        with open(args.sequences) as f:
            seqs = {s["name"]: s["ids"] for s in json.load(f)["sequences"]}
    else:
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        seqs = {f"random{n}": rng.integers(0, min(vocab, 32000), n).tolist()
                for n in (int(x) for x in args.lengths.split(","))}
    print(json.dumps(measure(model, seqs, greedy=args.greedy, kv_type=args.kv_type), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
