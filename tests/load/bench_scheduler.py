"""Concurrent completions through the scheduler, and a shared system prompt through its prefix cache.

Run by hand, not by pytest: `python tests/load/bench_scheduler.py [MODEL.gguf]` (default: the demo
model). Prints (1) aggregate generated tokens/s of 1, 4 and 8 concurrent greedy completions (each its
own --prompt-token prompt, the same length for every request and count; --tokens long), with the ratio
to one alone; (2) time to first token of a
128-token prompt alone and while 7 others decode; (3) time to first token of 10 requests that share
a --system-token prompt and differ in a short tail, the first one filling the cache.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.model import load_model
from minecart.engine.prefix_cache import PrefixCache
from minecart.engine.sampling import greedy_params
from minecart.engine.scheduler import Scheduler


def concurrent_rate(sched: Scheduler, n: int, tokens: int, seed: int, prompt: int = 20) -> tuple[float, float]:
    """(generated tokens/s over wall-clock time, the same over this process's CPU time) of n
    concurrent greedy completions, each of its own `prompt`-token prompt: every request the same size
    whatever n, so n at once against one alone compares the same work."""
    rng = np.random.default_rng(seed)
    prompts = [[2] + [int(t) for t in rng.integers(1000, 20000, prompt - 1)] for _ in range(n)]
    counts = [0] * n

    def run(i: int) -> None:
        for ev in sched.generate(prompts[i], greedy_params(max_tokens=tokens)):
            counts[i] = ev.generated_tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(counts) / wall, sum(counts) / max(cpu, 1e-9)


def shared_prompt(model, system_tokens: int, requests: int) -> list[float]:
    rng = np.random.default_rng(7)
    system = [2] + [int(t) for t in rng.integers(1000, 20000, system_tokens - 1)]
    sched = Scheduler(model, parallel=2, prefix_cache=PrefixCache(block=256))
    ttft = []
    try:
        for _ in range(requests):
            tail = [int(t) for t in rng.integers(1000, 20000, 12)]
            t0 = time.perf_counter()
            for _ev in sched.generate(system + tail, greedy_params(max_tokens=1)):
                ttft.append(time.perf_counter() - t0)
                break
    finally:
        sched.close()
    return ttft


def ttft_while_others_decode(model, others: int, prompt_tokens: int) -> tuple[float, float]:
    """(time to first token of a prompt alone, the same while `others` sequences decode)."""
    rng = np.random.default_rng(11)
    prompt = [2] + [int(t) for t in rng.integers(1000, 20000, prompt_tokens - 1)]
    sched = Scheduler(model, parallel=others + 1)
    try:
        def first_token() -> float:
            t0 = time.perf_counter()
            for _ev in sched.generate(prompt, greedy_params(max_tokens=1)):
                break
            return time.perf_counter() - t0

        alone = first_token()
        stop = threading.Event()

        def decode(i: int) -> None:
            p = [2] + [int(t) for t in rng.integers(1000, 20000, 8 + i)]
            for _ev in sched.generate(p, greedy_params(max_tokens=100000), cancel=stop):
                pass

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(others)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while sched.metrics()["batch_size"] < others and time.time() < deadline:
            time.sleep(0.05)
        busy = first_token()
        stop.set()
        for t in threads:
            t.join()
    finally:
        sched.close()
    return alone, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF file (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per completion")
    ap.add_argument("--prompt", type=int, default=20, help="tokens of each completion's prompt")
    ap.add_argument("--system", type=int, default=2048, help="tokens of the shared system prompt")
    ap.add_argument("--context", type=int, default=None,
                    help="the context the model is loaded with (default: the engine's; a 4,096-token system "
                         "prompt needs more than 4,096)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the concurrent runs; best counts")
    ap.add_argument("--parts", default="concurrent,ttft,shared",
                    help="which of the three measurements to run, comma separated (default all)")
    ap.add_argument("--rows-kernel", choices=("on", "off"), default="on",
                    help="off: batched matmuls on BLAS instead of engine/cpu_matmul.py")
    ap.add_argument("--attention-kernel", choices=("on", "off"), default="on",
                    help="off: a decode token's attention on NumPy instead of engine/cpu_attention.py")
    ap.add_argument("--pointwise-kernel", choices=("on", "off"), default="on",
                    help="off: norms, gated activations and RoPE on NumPy instead of engine/cpu_pointwise.py")
    ap.add_argument("--cpu-weights", choices=("float32", "stored"), default="stored",
                    help="how the model holds its weights (load_model(cpu_weights=)); stored is what "
                         "minecart serve runs, float32 the exact reference")
    args = ap.parse_args()
    if args.model:
        path = Path(args.model)
    else:
        from minecart.engine.demo import demo_model_path

        path = demo_model_path()
    model = load_model(path, devices=["cpu:0"], cpu_weights=args.cpu_weights, context=args.context)
    for st in model.executor.stages:
        if isinstance(st.backend, NumpyBackend):
            st.backend.rows_kernel = args.rows_kernel == "on"
            st.backend.attention_kernel = args.attention_kernel == "on"
            st.backend.pointwise_kernel = args.pointwise_kernel == "on"
    parts = set(args.parts.split(","))
    if not parts <= {"concurrent", "ttft", "shared"}:
        raise SystemExit(f"--parts: {args.parts!r} (concurrent, ttft, shared)")
    if "concurrent" in parts:
        sched = Scheduler(model, parallel=8, max_queue=8)
        try:
            concurrent_rate(sched, 8, 2, 0)  # warm-up (and the rows kernel's compilation)
            rates = {n: (0.0, 0.0) for n in (1, 4, 8)}
            for _ in range(args.repeat):  # the sizes take turns; the best of each counts
                for n in rates:
                    wall, cpu = concurrent_rate(sched, n, args.tokens, n, args.prompt)
                    rates[n] = (max(rates[n][0], wall), max(rates[n][1], cpu))
            m = sched.metrics()
        finally:
            sched.close()
        for i, label in ((0, "wall"), (1, "cpu time")):
            print(f"{path.name} [{label}, {args.cpu_weights} weights, rows kernel {args.rows_kernel}, attention "
                  f"kernel {args.attention_kernel}, pointwise kernels {args.pointwise_kernel}]: " + ", ".join(
                f"{n} concurrent: {r[i]:.1f} tok/s ({r[i] / rates[1][i]:.2f}x)" for n, r in rates.items())
                + f"; mean batch {m['batch_size_mean']:.2f}", flush=True)
    if "ttft" in parts:
        alone, busy = ttft_while_others_decode(model, 7, 128)
        print(f"time to first token of a 128-token prompt: alone {alone:.2f} s, while 7 others decode "
              f"{busy:.2f} s ({busy / alone:.2f}x)", flush=True)
    if "shared" in parts:
        ttft = shared_prompt(model, args.system, 10)
        later = max(ttft[1:])
        print(f"shared {args.system}-token prompt, 10 requests: first TTFT {ttft[0]:.2f} s, later "
              f"{min(ttft[1:]):.2f}-{later:.2f} s ({later / ttft[0]:.1%} of the first)", flush=True)
    model.close()


if __name__ == "__main__":
    main()
