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
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens before the decode (default 256)")
    ap.add_argument("--top", type=int, default=1, help="top logits a step returns (0: the whole row)")
    ap.add_argument("--links", default="none,1000GB/s+0us,gen1x1")
    ap.add_argument("--dir", default="/tmp/bench")
    ap.add_argument("--physical", default="cuda:0", help="the device both logical ones share (cpu:0: a smoke test)")
    args = ap.parse_args()
    from minecart.engine.config import ModelConfig
    from minecart.engine.gguf_file import GGUFFile
    from minecart.engine.model import load_model
    from minecart.engine.placement import Placement, model_costs
    from minecart.engine.rig import Rig
    from minecart.engine.sampling import TopLogits
    from minecart.engine.synth import write_synthetic

    path = f"{args.dir}/{args.shape}-{args.quant}-L{args.layers or 'all'}.gguf"
    if not os.path.exists(path):
        os.makedirs(args.dir, exist_ok=True)
        write_synthetic(path, args.shape, args.quant, n_layers=args.layers or None)
    with GGUFFile(path) as gf:
        costs = model_costs(ModelConfig.from_gguf(gf), gf)
    kind = args.physical.split(":")[0]
    n = costs.n_layers
    plan = Placement.from_layer_counts(costs, [(f"{kind}:0", n // 2), (f"{kind}:1", n - n // 2)])
    for name in args.links.split(","):
        link = None if name == "none" else name
        rig = Rig.logical(args.physical, [None, None], link=link)
        with load_model(path, placement=plan, devices=rig) as model:
            ex = model.executor
            states = model.new_state(args.prompt + 8 * args.tokens + 16)
            prompt = [100 + i % 1000 for i in range(args.prompt)]
            logits = model.forward(prompt, states, np.arange(args.prompt), rows="last", chunk=2048)
            token, pos = int(np.argmax(logits[-1])), args.prompt

            def run(n: int, states: list = states) -> float:
                nonlocal token, pos
                t0 = time.perf_counter()
                for _ in range(n):
                    out = model.forward([token], states, np.array([pos]), rows="last", top=args.top)
                    token = int(out.ids[0, 0]) if isinstance(out, TopLogits) else int(np.argmax(out[-1]))
                    pos += 1
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
