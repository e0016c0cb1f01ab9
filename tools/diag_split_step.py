"""Where a split decode token's time goes with and without a simulated riser (engine/rig.py): a model
split over 2 logical devices of one GPU, decoded through the stages' graphs, once per link, with the
host's calls profiled. Run on the GPU machine from the repo root with minecart importable:

    python3 tools/diag_split_step.py [--shape qwen3.5-9b] [--quant q8_0] [--layers 8] [--tokens 64]

Prints per link: ms a token (median of three rounds), the stage steps replayed as graphs and run
eagerly, the link time charged a token, and the host functions with the most own time (cProfile, one
more round). What this is not: the benchmark (`minecart bench --devices`)."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--links", default="none,1000GB/s+0us,gen1x1")
    ap.add_argument("--dir", default="/tmp/bench")
    ap.add_argument("--physical", default="cuda:0", help="the device both logical ones share (cpu:0: a smoke test)")
    args = ap.parse_args()
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.model import load_model
    from minecart.engine.placement import Placement, model_costs
    from minecart.engine.rig import Rig
    from minecart.engine.synth import write_synthetic

    path = f"{args.dir}/{args.shape}-{args.quant}-L{args.layers}.gguf"
    if not os.path.exists(path):
        os.makedirs(args.dir, exist_ok=True)
        write_synthetic(path, args.shape, args.quant, n_layers=args.layers)
    with GGUFFile(path) as gf:
        costs = model_costs(ModelConfig.from_gguf(gf), gf)
    kind = args.physical.split(":")[0]
    half = args.layers // 2
    plan = Placement.from_layer_counts(costs, [(f"{kind}:0", half), (f"{kind}:1", args.layers - half)])
    for name in args.links.split(","):
        link = None if name == "none" else name
        rig = Rig.logical(args.physical, [None, None], link=link)
        with load_model(path, placement=plan, devices=rig) as model:
            ex = model.executor
            states = model.new_state(512)
            logits = model.forward(list(range(100, 356)), states, np.arange(256), rows="last")
            token, pos = int(np.argmax(logits[-1])), 256

            def run(n: int) -> float:
                nonlocal token, pos
                t0 = time.perf_counter()
                for _ in range(n):
                    out = model.forward([token], states, np.array([pos]), rows="last", top=1)
                    token, pos = int(out.ids[0, 0]), pos + 1
                return (time.perf_counter() - t0) / n

            run(4)  # captures
            g0, e0 = ex.graphed_stage_steps, ex.eager_stage_steps
            before = [rig.backend(n).transfer_seconds for n in rig.names]
            per = statistics.median(run(args.tokens) for _ in range(3))
            steps = 3 * args.tokens
            charged = sum(rig.backend(n).transfer_seconds - b for n, b in zip(rig.names, before, strict=True)) / steps
            print(f"link {name}: {per * 1e3:.3f} ms a token ({1 / per:.1f} tok/s); graphed stage steps "
                  f"{ex.graphed_stage_steps - g0}, eager {ex.eager_stage_steps - e0}; link charged "
                  f"{charged * 1e6:.1f} us a token")
            prof = cProfile.Profile()
            prof.enable()
            run(args.tokens)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
            print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))
            model._free_states(states)


if __name__ == "__main__":
    main()
