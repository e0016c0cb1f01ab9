"""Aggregate decode tokens/s of B concurrent sequences through Executor.forward_batch (B = 1, 4, 8).

Run by hand, not by pytest: `python tests/load/bench_batch_decode.py [MODEL.gguf ...]` (default: the
demo model and the Qwen3.5 fixture). Every sequence first prefills its own prompt (different
lengths), then all decode together for --steps greedy steps; the rate is B * steps / seconds of the
decode steps only. One sequence alone runs through the same call (a batch of one is Executor.forward).

The machine this runs on is often shared, so each batch size is measured --repeat times, the sizes
taking turns, and the best run counts. Besides wall-clock rates it prints rates over the process's
CPU time (the engine runs one thread here), which other programs' load disturbs far less.
--rows-kernel off runs the batch's matmuls on BLAS instead of engine/cpu_matmul.py, --gdn-kernel off
the Gated DeltaNet recurrence on its NumPy twin instead of engine/cpu_gdn.py, --attention-kernel off a
decode token's attention on its NumPy twin instead of engine/cpu_attention.py (the "befores").
--weights stored holds the matmul weights as the file stores them and multiplies int8 activations
(engine/cpu_experts.py dense_matmul, as a plan beside a GPU holds the CPU's layers); float32 is the
reference backend's decoded copies.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.model import load_model


def decode_rate(model, batch: int, steps: int, seed: int = 0) -> tuple[float, float]:
    """(tokens/s over wall-clock time, tokens/s over this process's CPU time) of `steps` batched
    greedy decode steps of `batch` sequences."""
    rng = np.random.default_rng(seed)
    sessions = [model.new_session(capacity=512) for _ in range(batch)]
    logits = [s.prefill(list(rng.integers(10, 1000, 8 + 5 * b))) for b, s in enumerate(sessions)]
    positions = [s.position for s in sessions]
    states = [s.states for s in sessions]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tokens = [[int(np.argmax(row))] for row in logits]
        out = model.executor.forward_batch(tokens, states, [np.array([p]) for p in positions])
        positions = [p + 1 for p in positions]
        logits = list(out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for s in sessions:
        s.close()
    return batch * steps / wall, batch * steps / max(cpu, 1e-9)


def measure(model, batches: list[int], steps: int, repeat: int) -> dict[int, tuple[float, float]]:
    """batch -> (best wall rate, best CPU-time rate) over `repeat` rounds, the sizes taking turns."""
    best = {b: (0.0, 0.0) for b in batches}
    for _ in range(repeat):
        for b in batches:
            wall, cpu = decode_rate(model, b, steps)
            best[b] = (max(best[b][0], wall), max(best[b][1], cpu))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("models", nargs="*", help="GGUF files (default: demo model and Qwen3.5 fixture)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--batches", default="1,4,8", help="batch sizes, comma separated")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best of each size counts")
    ap.add_argument("--rows-kernel", choices=("on", "off"), default="on",
                    help="off: batched matmuls on BLAS instead of engine/cpu_matmul.py")
    ap.add_argument("--gdn-kernel", choices=("on", "off"), default="on",
                    help="off: the Gated DeltaNet recurrence on NumPy instead of engine/cpu_gdn.py")
    ap.add_argument("--attention-kernel", choices=("on", "off"), default="on",
                    help="off: a decode token's attention on NumPy instead of engine/cpu_attention.py")
    ap.add_argument("--weights", choices=("float32", "stored"), default="float32",
                    help="stored: matmul weights as the file stores them, on the integer kernels")
    args = ap.parse_args()
    paths = [Path(p) for p in args.models]
    if not paths:
        from minecart.engine.demo import demo_model_path

        paths = [demo_model_path(), Path("/work/shared/fixtures/dense/qwen35-tiny-dense-f16.gguf")]
    batches = [int(x) for x in args.batches.split(",")]
    for path in paths:
        model = load_model(path, backend=NumpyBackend(rows_kernel=args.rows_kernel == "on",
                                                      gdn_kernel=args.gdn_kernel == "on",
                                                      attention_kernel=args.attention_kernel == "on",
                                                      int_weights=args.weights == "stored"))
        decode_rate(model, max(batches), 2)  # warm-up (and the kernel's compilation)
        rates = measure(model, batches, args.steps, args.repeat)
        base = min(batches)
        for i, label in ((0, "wall"), (1, "cpu time")):
            print(f"{path.name} [{label}, {args.weights} weights, rows kernel {args.rows_kernel}, "
                  f"gdn kernel {args.gdn_kernel}, attention kernel {args.attention_kernel}]: " + ", ".join(
                f"B={b}: {r[i]:.1f} tok/s ({r[i] / rates[base][i]:.2f}x)" for b, r in rates.items()),
                flush=True)
        # Linux reports KiB; the peak of the whole process, so of this model only when it is the first
        print(f"{path.name}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
              f"({args.weights} weights)", flush=True)
        model.close()


if __name__ == "__main__":
    main()
