"""The planner (engine/placement.py) against what the engine really does: peak device memory per device
and prefill / decode tokens/s, predicted vs measured.

    python tools/plan_vs_measured.py run [--shapes qwen3.5-9b,qwen3.5-27b] [--quant q4_k] [--layers 16]
        [--context 32768] [--prompt 2048] [--decode 64] [--link gen1x1] [--full] [--dir DIR] [--json OUT.json]
    python tools/plan_vs_measured.py report split.json --shape qwen3.5-9b --quant q4_k --card H200

`run` synthesizes each shape once (engine/synth.py, kept in --dir and reused by later runs), then for
each row (1 device; 2 and 3 logical devices with memory caps, engine/rig.py) plans the split with
plan_auto, loads the file with that plan, allocates a session for the whole --context (the KV cache the
plan priced), prefills a --prompt token prompt in chunks of --chunk and decodes --decode tokens (CUDA
graphs, as the engine runs), and prints a table and, with --json, the rows as JSON:

- memory, per GPU, two peaks:
  - the run's: the highest device memory in use (total - free) sampled during the load (after each
    weight), after the prefill and after the decode: the CUDA context, CuPy's pool with its holes,
    kernel modules, graph executables. Predicted = the plan's DeviceBytes total less `staging` (the
    load's excess over the run), with the context measured on the device;
  - the load's: the CUDA context + the pool's high-water mark while the weights uploaded
    (CupyBackend.load_memory_peak: the backend hands each upload's temporaries, a K-quant repack's or
    a staged copy's, back to the device before the next weight, and notes the pool's total first).
    Predicted = context + Placement.load_peak (logical devices sharing a GPU load in order, each
    beside the weights of those before it). Logical devices sharing one GPU are compared on that GPU (their resident
  bytes added up, the widest scratch once, one context) and each on its resident arrays (weights, KV
  cache, state: rig.allocated_bytes) against the plan's resident bytes. Target: within 5%.
- speed: measured prefill and decode tokens/s against predict_speed with the card's profile (--card,
  resources/gpu_profiles.json) and the row's link; decode is predicted at the context it runs at
  (prompt + half the decode), logical devices on one GPU get the no-overlap prefill prediction.
  Target: within 15%.
- calibration (the single-device rows): device memory outside the pool beyond the context after an
  eager decode step (kernel modules: placement.KERNEL_MODULES_BYTES, plus what the driver rounds the
  KV caches, states and scratch up by, not priced; the weights' arenas are whole pages in the pool, their
  padding DeviceBytes.rounding, `rounding_predicted`) and what capturing the decode graphs
  adds, per layer (placement.GRAPH_BYTES_PER_LAYER).

--link puts every device of the split rows behind that simulated riser (engine/rig.py; its time is
charged on the GPU streams between the stages' graphs). --full is the issue's table at full depth:
--layers 0 --context 8192 --prompt 1024 --decode 32 and the split rows behind --link (default gen1x1);
run one shape per device call (the synthesized 27B Q4_K file is ~16 GB and is written first).

--layers keeps the first N layers of each shape (0 = all): the prediction is made for exactly the file
that runs, so the comparison holds at any depth, and per-layer costs (what a split moves) are what is
under test; the embedding and LM head weigh more in a shallow file. The default, 16, keeps a 27B run
(synthesis, three loads, prefill, decode) within about five minutes on an H200; `minecart plan`
prices the full model from the same costs.

`report` compares a `minecart bench --devices ... --json` report with the speed model for the plan the
engine ran (for docs/BENCHMARKS.md).

--cpu runs the rows on CPU devices (NumPy backends: a smoke test of the tool; only resident bytes are
compared there). What this is not: a benchmark of the kernels (`minecart bench`) or a calibration
that changes anything (the constants live in engine/placement.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from minecart.engine import gpu_profiles, load_model
from minecart.engine.config import ModelConfig
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.placement import (
    CUDA_CONTEXT_BYTES,
    DeviceSpec,
    GiB,
    Placement,
    costs_for_shape,
    model_costs,
    plan_auto,
    predict_speed,
)
from minecart.engine.rig import Rig, allocated_bytes

# ---- report: a split benchmark's JSON against the speed model ---------------------------------------


def compare(report: dict[str, Any], shape: str, quant: str, card: str, kv_type: str) -> list[dict[str, Any]]:
    """One dict per benchmark row: config, measured and predicted prefill/decode tokens/s and ratios."""
    costs = costs_for_shape(shape, quant.upper())
    speed = gpu_profiles.card(card).speed
    prompt = int(report["prompt_tokens"])
    context = prompt + 2 * int(report["decode_tokens"]) + 4  # the bench's session capacity
    physical = max(1, int(report.get("physical_gpus") or 1))
    out = []
    for row in report["rows"]:
        rig = Rig.parse(row["devices"], physical_gpus=physical)
        specs = rig.device_specs()
        plan = plan_auto(costs, devices=specs).with_settings(context=context, chunk=int(report["chunk"]),
                                                             kv_type=kv_type)
        timed = [DeviceSpec(d.name, d.free_bytes, speed=speed, link=d.link) for d in specs]
        p = predict_speed(plan, timed, prompt=prompt, logits_over_link=False)
        shared = len({rig.device(n).physical for n in plan.devices_used()}) < len(plan.devices_used())
        pre = p.prefill_one_gpu_tokens_per_s if shared else p.prefill_tokens_per_s
        dec = p.decode_at_context_tokens_per_s  # the bench decodes after its prompt
        out.append({"config": row["config"], "prefill": row["prefill_tokens_per_s"], "prefill_predicted": pre,
                    "prefill_ratio": row["prefill_tokens_per_s"] / pre, "decode": row["decode_tokens_per_s"],
                    "decode_predicted": dec, "decode_ratio": row["decode_tokens_per_s"] / dec,
                    "shared_gpu": shared})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | prefill tok/s | predicted | measured/predicted | decode tok/s | predicted | "
             "measured/predicted |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']}{' (one GPU)' if r['shared_gpu'] else ''} | {r['prefill']:.1f} | "
                     f"{r['prefill_predicted']:.1f} | {r['prefill_ratio']:.2f} | {r['decode']:.1f} | "
                     f"{r['decode_predicted']:.1f} | {r['decode_ratio']:.2f} |")
    return "\n".join(lines)


# ---- run: load, prefill, decode, measure ------------------------------------------------------------


@dataclass(frozen=True)
class RowSpec:
    """One configuration: a label and the rig it runs on (engine/rig.py Rig.parse text)."""

    config: str
    rig: str


def row_specs(single_bytes: int, kind: str = "cuda", link: str = "") -> list[RowSpec]:
    """1 device; 2 devices with equal caps; 3 devices capped 8:8:6 (the 27B target rig's shape). The
    caps are sized from the single-device estimate (`single_bytes`, context excluded) so that each
    split needs every device: 60% of it per device for two, 44/44/33% for three. link (an engine/rig.py
    LINKS name or rate): every device of the split rows sits behind that simulated riser."""
    at = f"@{link}" if link else ""

    def cap(fraction: float) -> str:
        return f"{max(1, int(single_bytes * fraction / (1 << 20)))}MiB{at}"

    return [RowSpec("1 device", f"{kind}:0"),
            RowSpec(f"2 devices{' ' + at if at else ''}", f"{kind}:0={cap(0.6)},{kind}:1={cap(0.6)}"),
            RowSpec(f"3 devices 8:8:6{' ' + at if at else ''}",
                    f"{kind}:0={cap(0.44)},{kind}:1={cap(0.44)},{kind}:2={cap(0.33)}")]


@dataclass
class _Gpu:
    """One physical GPU of a row: the real backends on it (one per logical device; they share the
    device's memory pool and context) and the device memory samples."""

    backends: list = field(default_factory=list)
    logical: list[str] = field(default_factory=list)
    peak_used: int = 0
    samples: dict[str, int] = field(default_factory=dict)

    @property
    def backend(self) -> Any:
        return self.backends[0]

    def sample(self, label: str = "") -> int:
        used = int(self.backend.peak_memory())
        self.peak_used = max(self.peak_used, used)
        if label:
            self.samples[label] = used
        return used

    def outside_pool(self, label: str) -> int:
        """Device memory in use outside the pool beyond the CUDA context (modules, graphs), now."""
        return self.sample(label) - int(self.backend.memory_used()) - int(self.backend.context_bytes)


def _gpus(rig: Rig) -> dict[str, _Gpu]:
    """Physical CUDA device -> _Gpu with the rig's logical devices on it (their backends made now)."""
    out: dict[str, _Gpu] = {}
    for d in rig.devices:
        if d.physical.startswith("cuda:"):
            g = out.setdefault(d.physical, _Gpu())
            g.backends.append(rig.backend(d.name).inner)
            g.logical.append(d.name)
    return out


def _set_graphs(model, gpus: dict[str, _Gpu], on: bool) -> None:
    model.executor.use_graphs = on
    for g in gpus.values():
        for be in g.backends:
            be.use_graphs = on


def measure_row(path: Path, costs, spec: RowSpec, *, context: int, prompt: int, decode: int, chunk: int,
                kv_type: str, physical_gpus: int, seed: int = 0) -> dict[str, Any]:
    """Plan, load, prefill, decode; the measurements and the plan (see the module doc)."""
    rig = Rig.parse(spec.rig, physical_gpus=physical_gpus)
    shared = len({d.physical for d in rig.devices}) < len(rig.devices)
    # the caps are bookkeeping of resident bytes (engine/rig.py): no reserve beyond them
    plan = plan_auto(costs, devices=rig.device_specs(), context=context, chunk=chunk, kv_type=kv_type,
                     cuda_context_bytes=0 if shared else CUDA_CONTEXT_BYTES, reserve=0)
    gpus = _gpus(rig)
    for g in gpus.values():
        g.sample("before load")

    def progress(_frac: float, _msg: str) -> None:  # after every weight: the load's peak
        for g in gpus.values():
            g.sample()

    t0 = time.perf_counter()
    model = load_model(path, placement=plan, devices=rig, kv_type=kv_type, mmproj=False, progress=progress)
    load_s = time.perf_counter() - t0
    try:
        for g in gpus.values():
            g.sample("after load")
        rng = np.random.default_rng(seed)
        ids = [int(t) for t in rng.integers(0, model.config.vocab_size, size=prompt + decode + 8)]
        warm = model.new_state(min(context, chunk + 8))  # compiles and loads the prefill kernels
        model.forward(ids[:chunk], warm, np.arange(chunk), chunk=chunk)
        model._free_states(warm)
        states = model.new_state(context)  # the whole planned context, as a session allocates it
        t0 = time.perf_counter()
        model.forward(ids[:prompt], states, np.arange(prompt), chunk=chunk)
        prefill_s = time.perf_counter() - t0
        for g in gpus.values():
            g.sample("after prefill")
        pos = prompt
        _set_graphs(model, gpus, False)
        model.forward([ids[pos]], states, np.array([pos]))  # eager: every decode kernel loaded, no graph
        pos += 1
        outside_eager = {ph: g.outside_pool("after eager step") for ph, g in gpus.items()}
        _set_graphs(model, gpus, True)
        for _ in range(3):  # capture the decode graphs, replay them
            model.forward([ids[pos]], states, np.array([pos]))
            pos += 1
        outside_graphs = {ph: g.outside_pool("after capture") for ph, g in gpus.items()}
        t0 = time.perf_counter()
        for _ in range(decode):
            model.forward([ids[pos]], states, np.array([pos]))
            pos += 1
        decode_s = time.perf_counter() - t0
        for g in gpus.values():
            g.sample("after decode")
        resident = {dev: allocated_bytes([model.weights[p] for p, d in model.device_plan.items() if d == dev]
                                         + [states[int(p.split(".")[1])] for p, d in model.device_plan.items()
                                            if d == dev and p.startswith("layer.")])
                    for dev in plan.devices_used()}
        model._free_states(states)
        layers_on = {ph: sum(1 for p, d in model.device_plan.items() if d in g.logical and p.startswith("layer."))
                     for ph, g in gpus.items()}
        # the pool's high-water mark while the weights uploaded (CupyBackend.load_memory_peak: noted
        # before each upload's temporaries went back to the device; one pool per GPU)
        load_pool = {ph: max(int(be.load_memory_peak()) for be in g.backends) for ph, g in gpus.items()}
        ctx = {ph: int(g.backend.context_bytes) for ph, g in gpus.items()}
    finally:
        model.close()
        for g in gpus.values():
            for be in g.backends:
                be.release_cached()  # graphs, cached copies, and the pool's free blocks back to the device
    return {"config": spec.config, "rig": spec.rig, "shared_gpu": shared, "plan": plan, "rig_obj": rig,
            "load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "prompt": prompt, "decode": decode,
            "gpus": {ph: {"logical": g.logical, "peak_used": g.peak_used, "samples": g.samples,
                          "context": ctx[ph], "outside_eager": outside_eager[ph],
                          "outside_graphs": outside_graphs[ph], "layers": layers_on[ph],
                          "load_pool_peak": load_pool[ph]}
                     for ph, g in gpus.items()},
            "resident": resident}


def predict_row(m: dict[str, Any], card: str) -> dict[str, Any]:
    """Predicted vs measured for one measured row (pure: testable without a GPU)."""
    plan: Placement = m["plan"]
    rig: Rig = m["rig_obj"]
    out: dict[str, Any] = {"config": m["config"], "rig": m["rig"], "shared_gpu": m["shared_gpu"],
                           "devices": {}, "gpus": {}}
    for dev, b in plan.bytes_per_device().items():
        out["devices"][dev] = {"predicted_resident": b.resident, "measured_resident": int(m["resident"][dev]),
                               "resident_ratio": m["resident"][dev] / b.resident if b.resident else 0.0}
    for ph, g in m["gpus"].items():
        priced = plan.with_settings(cuda_context_bytes=g["context"]).bytes_per_device()
        mine = [priced[d] for d in g["logical"]]
        if len(mine) == 1:
            predicted = mine[0].total
            run_predicted = predicted - mine[0].staging
        else:  # one GPU, several logical devices: resident bytes add up, one scratch, one context
            rest = sum(b.total - b.overhead - b.activations for b in mine) + g["context"] + mine[0].modules + sum(
                b.graphs + b.rounding for b in mine)
            predicted = rest + max(b.activations for b in mine)
            run_predicted = rest + max(b.activations - b.staging for b in mine)
        graphs = g["outside_graphs"] - g["outside_eager"]
        # the load: the pool at its peak beside the context, the logical devices loaded in order (each
        # after the ones before it, whose weights stay); the run: the estimate without the load's excess
        before = load_predicted = 0
        for d, b in zip(g["logical"], mine, strict=True):
            load_predicted = max(load_predicted, before + plan.load_peak(d))
            before += b.weights
        load_measured = g["load_pool_peak"]
        out["gpus"][ph] = {"logical": g["logical"], "predicted_peak": int(predicted), "measured_peak": g["peak_used"],
                           "ratio": g["peak_used"] / predicted if predicted else 0.0, "context": g["context"],
                           "modules_measured": g["outside_eager"], "modules_predicted": mine[0].modules,
                           "rounding_predicted": sum(b.rounding for b in mine),
                           "graphs_measured": graphs, "graphs_predicted": sum(b.graphs for b in mine),
                           "graph_bytes_per_layer_measured": graphs / g["layers"] if g["layers"] else 0.0,
                           "load_measured": g["context"] + load_measured,
                           "load_predicted": g["context"] + load_predicted,
                           "load_ratio": (load_measured / load_predicted) if load_predicted else 0.0,
                           "run_predicted": int(run_predicted),
                           "run_ratio": g["peak_used"] / run_predicted if run_predicted else 0.0,
                           "samples": g["samples"]}
    speed = gpu_profiles.card(card).speed if card else None
    specs = {d.name: d for d in rig.device_specs()}
    timed = [DeviceSpec(n, specs[n].free_bytes, speed=speed or specs[n].speed, link=specs[n].link)
             for n in plan.devices_used()]
    at = plan.with_settings(context=m["prompt"] + m["decode"] // 2)  # decode reads the filled context
    p = predict_speed(at, timed, prompt=m["prompt"], logits_over_link=False)
    pre = p.prefill_one_gpu_tokens_per_s if m["shared_gpu"] else p.prefill_tokens_per_s
    dec = p.decode_at_context_tokens_per_s
    pre_m = m["prompt"] / m["prefill_s"]
    dec_m = m["decode"] / m["decode_s"]
    out.update(prefill=pre_m, prefill_predicted=pre, prefill_ratio=pre_m / pre, decode=dec_m,
               decode_predicted=dec, decode_ratio=dec_m / dec, load_s=m["load_s"])
    return out


def run_table(rows: list[dict[str, Any]]) -> str:
    """The issue's table: per GPU the run's peak (device memory in use after the load, the prefill and
    the decode) and the load's peak (CUDA context + the pool's high-water mark while the weights
    uploaded), each measured / predicted; resident bytes per logical device; prefill and decode tokens/s
    measured (predicted, measured / predicted)."""
    lines = ["| shape | config | device | run peak: measured / predicted | ratio | load peak: measured / "
             "predicted | ratio | prefill tok/s (pred, ratio) | decode tok/s (pred, ratio) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        speed = (f"{r['prefill']:.0f} ({r['prefill_predicted']:.0f}, {r['prefill_ratio']:.2f}) | "
                 f"{r['decode']:.1f} ({r['decode_predicted']:.1f}, {r['decode_ratio']:.2f})")
        for ph, g in r["gpus"].items():
            lines.append(f"| {r['shape']} | {r['config']} | {ph} ({', '.join(g['logical'])}) | "
                         f"{g['measured_peak'] / GiB:.3f} / {g['run_predicted'] / GiB:.3f} GiB | "
                         f"{g['run_ratio']:.3f} | {g['load_measured'] / GiB:.3f} / {g['load_predicted'] / GiB:.3f} "
                         f"GiB | {g['load_ratio']:.3f} | {speed} |")
            speed = "| "
        for dev, d in r["devices"].items():
            if r["shared_gpu"] or not r["gpus"]:
                lines.append(f"| {r['shape']} | {r['config']} | {dev} resident | "
                             f"{d['measured_resident'] / GiB:.3f} / {d['predicted_resident'] / GiB:.3f} GiB | "
                             f"{d['resident_ratio']:.3f} | | | {speed} |")
                speed = "| "
    return "\n".join(lines)


def worst_misses(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(largest memory miss, largest speed miss) as fractions."""
    mem = [abs(g[k] - 1) for r in rows for g in r["gpus"].values() for k in ("run_ratio", "load_ratio")]
    mem += [abs(d["resident_ratio"] - 1) for r in rows for d in r["devices"].values()]
    spd = [max(abs(r["prefill_ratio"] - 1), abs(r["decode_ratio"] - 1)) for r in rows]
    return max(mem, default=0.0), max(spd, default=0.0)


def synthesize(shape: str, quant: str, layers: int, directory: Path) -> Path:
    """The synthetic file of `shape` (kept in `directory`, reused when already there)."""
    from minecart.engine.synth import write_synthetic

    path = directory / f"{shape}-{quant}-{layers or 'all'}L.gguf"
    if not path.exists():
        tmp = path.with_suffix(".part")
        write_synthetic(tmp, shape, quant, seed=1, n_layers=layers or None, mtp=False)
        tmp.rename(path)
    return path


FULL = {"layers": 0, "context": 8192, "prompt": 1024, "decode": 32}  # --full: whole models, short runs


def run(args) -> int:
    if args.full:
        for k, v in FULL.items():
            setattr(args, k, v)
        args.link = args.link or "gen1x1"
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    kind = "cpu" if args.cpu else "cuda"
    physical = 1
    if not args.cpu:
        from minecart.engine.backends.cupy_backend import device_count

        physical = max(1, min(device_count(), 3))
    rows = []
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        t0 = time.perf_counter()
        path = synthesize(shape, args.quant, args.layers, directory)
        print(f"{shape}: {path.name} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        gf = GGUFFile(path)
        try:
            costs = model_costs(ModelConfig.from_gguf(gf), gf, layout="numpy" if args.cpu else "stored")
        finally:
            gf.close()
        single = Placement.single(costs, f"{kind}:0", context=args.context, chunk=args.chunk,
                                  kv_type=args.kv_type).bytes_per_device()[f"{kind}:0"]
        for spec in row_specs(single.total - single.overhead, kind, args.link):
            t0 = time.perf_counter()
            m = measure_row(path, costs, spec, context=args.context, prompt=args.prompt, decode=args.decode,
                            chunk=args.chunk, kv_type=args.kv_type, physical_gpus=physical)
            r = predict_row(m, "" if args.cpu else args.card)
            r["shape"] = shape
            rows.append(r)
            print(f"  {spec.config}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(run_table(rows))
    mem, spd = worst_misses(rows)
    print(f"largest memory miss {100 * mem:.1f}% (target 5%), largest speed miss {100 * spd:.1f}% "
          f"(target 15%)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "func"},
                                               "rows": rows}, indent=1, default=str))
    return 0


def report(args) -> int:
    data = json.loads(Path(args.report).read_text())
    rows = compare(data, args.shape, args.quant, args.card, args.kv_type)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    worst = max(max(abs(r["prefill_ratio"] - 1), abs(r["decode_ratio"] - 1)) for r in rows)
    print(f"largest miss: {100 * worst:.0f}% (target: within 15%)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="synthesize, load, prefill, decode, and compare with the plan")
    r.add_argument("--shapes", default="qwen3.5-9b,qwen3.5-27b", help="comma-separated shapes (engine/models/qwen35.py)")
    r.add_argument("--quant", default="q4_k", help="quant type of the synthesized files (default q4_k)")
    r.add_argument("--layers", type=int, default=16, help="keep the first N layers of each shape, 0 = all (default 16)")
    r.add_argument("--context", type=int, default=32768, help="context the sessions are allocated for (default 32768)")
    r.add_argument("--prompt", type=int, default=2048, help="prompt tokens prefilled (default 2048)")
    r.add_argument("--decode", type=int, default=64, help="tokens decoded (default 64)")
    r.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    r.add_argument("--kv-type", default="f16", help="KV cache type (default f16)")
    r.add_argument("--card", default="H200", help="card profile for the speed prediction (default H200)")
    r.add_argument("--dir", default="/tmp/minecart-plan-vs-measured", help="where the synthesized files are kept")
    r.add_argument("--json", default="", help="also write the rows as JSON to this file")
    r.add_argument("--link", default="", help="simulated riser of every device in the split rows, e.g. gen1x1 "
                   "(engine/rig.py LINKS or a rate; default none)")
    r.add_argument("--full", action="store_true", help="whole models (--layers 0) with a short run: --context "
                   "8192 --prompt 1024 --decode 32, split rows behind --link (default gen1x1); one shape per "
                   "device call (estimated on an H200, synthesis included: 9B ~2.5 min, 27B ~4 min)")
    r.add_argument("--cpu", action="store_true", help="run on CPU devices (a smoke test; resident bytes only)")
    r.set_defaults(func=run)
    b = sub.add_parser("report", help="a `minecart bench --devices ... --json` report against the speed model")
    b.add_argument("report", help="the JSON of `minecart bench --devices ... --json`")
    b.add_argument("--shape", required=True, help="the shape the benchmark synthesized, e.g. qwen3.5-9b")
    b.add_argument("--quant", default="q8_0", help="its quant type (default q8_0)")
    b.add_argument("--card", default="H200", help="the card profile the benchmark ran on (default H200)")
    b.add_argument("--kv-type", default="f32", help="the KV cache type the benchmark ran with (default f32)")
    b.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    b.set_defaults(func=report)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
