"""Time what a first-time user waits for: opening a GGUF, loading weights, building the tokenizer and
chat template, the first token, and decode speed, on the NumPy backend (CPU).

Every run is a fresh Python process (nothing warm in memory; the OS page cache is warm after the first
run, as it is for a user who starts the app twice). Each phase reports wall seconds and CPU seconds
(time.process_time(), all threads of the process), so a busy shared machine shows up as wall >> CPU.
The parent prints medians over the runs, per BLAS thread setting.

    python tools/profile_first_run.py                      # demo + Qwen fixture, 3 runs, 1 and default threads
    python tools/profile_first_run.py --model demo --runs 5 --threads 1
    python tools/profile_first_run.py --tokenizer-cache warm   # a start after the first one
    python tools/profile_first_run.py --sequential             # lazy tokenizer and LM head (no overlap)

What this is not: a benchmark of the GPU path (engine/cli/bench_cmd.py) or a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN_FIXTURE = Path("/work/shared/fixtures/dense/qwen35-tiny-dense-q8_0.gguf")
PROMPT = "The capital of Germany is"
PHASES = ("import", "open", "load.global", "load.layers", "load.head", "load_total", "tokenizer",
          "chat_template", "encode", "first_token", "decode")


def _child(model_arg: str, n_tokens: int, sequential: bool) -> dict:
    """One measured first run in this process; returns {phase: [wall, cpu]} plus extras."""
    result: dict = {}
    w0, c0 = time.perf_counter(), time.process_time()

    def mark(name: str, since: tuple[float, float]) -> tuple[float, float]:
        now = (time.perf_counter(), time.process_time())
        result[name] = [now[0] - since[0], now[1] - since[1]]
        return now

    from minecart.engine.model import load_model
    from minecart.engine.sampling import greedy_params

    t = mark("import", (w0, c0))
    if model_arg == "demo":
        from minecart.engine.demo import demo_model_path

        path = demo_model_path()
    elif model_arg == "qwen":
        path = QWEN_FIXTURE
    else:
        path = Path(model_arg)

    # load_model's progress: "opening ..." once the file, config and tensor checks are done, then one
    # call per tensor "part: name"; the time between two calls belongs to the tensor just finished.
    part_time: dict[str, list[float]] = {}
    last = [time.perf_counter(), time.process_time()]

    def progress(fraction: float, message: str) -> None:
        now = (time.perf_counter(), time.process_time())
        if message.startswith("opening"):
            result["open"] = [now[0] - last[0], now[1] - last[1]]
        elif ":" in message:
            part = message.split(":", 1)[0]
            group = "load.layers" if part.startswith("layer.") else f"load.{part}"
            acc = part_time.setdefault(group, [0.0, 0.0])
            acc[0] += now[0] - last[0]
            acc[1] += now[1] - last[1]
        last[0], last[1] = now

    # Without a progress callback load_model keeps everything lazy (tokenizer and LM head built on
    # first use, one after another); with one it overlaps the tokenizer with the weights.
    model = load_model(path, devices=["cpu:0"], progress=None if sequential else progress, mmproj=False)
    t = mark("load_total", t)
    result.update(part_time)
    tok = model.tokenizer
    t = mark("tokenizer", t)
    tmpl = model.chat_template
    t = mark("chat_template", t)
    ids = tok.encode(PROMPT, add_special=True)
    t = mark("encode", t)
    events = model.generate(ids, greedy_params(max_tokens=n_tokens))
    first = next(events)
    t = mark("first_token", t)
    rest = list(events)
    t = mark("decode", t)
    n_decoded = len(rest)
    result["decode_tokens"] = n_decoded
    result["decode_tps_wall"] = n_decoded / result["decode"][0] if n_decoded else None
    result["decode_tps_cpu"] = n_decoded / result["decode"][1] if n_decoded and result["decode"][1] else None
    result["text"] = tok.decode([first.token] + [e.token for e in rest if e.token is not None])
    result["template"] = tmpl is not None
    import resource

    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _run_once(model_arg: str, threads: str, n_tokens: int, cache_dir: str | None, cold: bool,
              sequential: bool = False) -> dict:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)
        if threads != "default":
            env[var] = threads
    if cache_dir is not None:
        env["MINECART_TOKENIZER_CACHE"] = cache_dir
        if cold:
            shutil.rmtree(cache_dir, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", model_arg, "--tokens", str(n_tokens)]
    if sequential:
        cmd.append("--sequential")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(model_arg: str, threads: str, runs: list[dict]) -> str:
    lines = [f"## {model_arg}, BLAS threads = {threads}, {len(runs)} runs (median wall s / median CPU s)"]
    for phase in PHASES:
        vals = [r[phase] for r in runs if phase in r]
        if not vals:
            continue
        wall = statistics.median(v[0] for v in vals)
        cpu = statistics.median(v[1] for v in vals)
        lines.append(f"  {phase:<14} {wall:8.3f} {cpu:8.3f}")
    tps_w = [r["decode_tps_wall"] for r in runs if r.get("decode_tps_wall")]
    tps_c = [r["decode_tps_cpu"] for r in runs if r.get("decode_tps_cpu")]
    if tps_w:
        lines.append(f"  decode tok/s   {statistics.median(tps_w):8.2f} {statistics.median(tps_c):8.2f}"
                     f"   ({runs[0]['decode_tokens']} tokens)")
    first_run = [r["load_total"][0] + r["tokenizer"][0] + r["chat_template"][0] + r["first_token"][0]
                 for r in runs]
    lines.append(f"  load->1st tok  {statistics.median(first_run):8.3f}   (load + tokenizer + template + first token, wall)")
    lines.append(f"  peak RSS MiB   {statistics.median(r['peak_rss_mib'] for r in runs):8.0f}")
    lines.append(f"  text: {runs[0]['text']!r}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo,qwen",
                    help="comma-separated: 'demo', 'qwen' (the shared fixture) or a GGUF path")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per model and thread setting")
    ap.add_argument("--threads", default="1,default", help="comma-separated BLAS thread counts ('default' = unset)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate (greedy)")
    ap.add_argument("--tokenizer-cache", choices=("cold", "warm", "user"), default="cold",
                    help="cold: a fresh empty tokenizer cache each run; warm: one temporary cache kept "
                         "across runs (filled by a run first); user: the real user cache, untouched")
    ap.add_argument("--sequential", action="store_true",
                    help="load without a progress callback: tokenizer and LM head built lazily, in turn")
    ap.add_argument("--json", help="also write every run's raw numbers to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.tokens, args.sequential)))
        return

    tmp = tempfile.mkdtemp(prefix="minecart-tokcache-")
    cache_dir = None if args.tokenizer_cache == "user" else tmp
    everything = {}
    try:
        for model_arg in args.model.split(","):
            for threads in args.threads.split(","):
                if args.tokenizer_cache == "warm":
                    _run_once(model_arg, threads, 1, cache_dir, cold=True)  # fill the cache
                runs = [_run_once(model_arg, threads, args.tokens, cache_dir, args.tokenizer_cache == "cold",
                                  args.sequential) for _ in range(args.runs)]
                everything[f"{model_arg}/{threads}"] = runs
                print(_table(model_arg, threads, runs), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
