"""`minecart plan`: will this model fit my rig, and how fast will it run? No cards and no weights needed.

    minecart plan MODEL.gguf --rig cuda:0=P104-100@gen1x1,cuda:1=CMP-100-210@gen1x1 --context 32768
    minecart plan --shape qwen3.5-27b --quant q4_k --rig cuda:0=8GiB,cuda:1=8GiB,cuda:2=6GiB --json
    minecart plan MODEL.gguf --exclude cuda:1      (this machine's GPUs, one left out)

The model is a GGUF file (only its header is read) or a named shape priced on paper
(engine/placement.py costs_for_shape). The rig is engine/rig.py's `NAME[=CAP|=CARD][@LINK]` list;
a card is a profile of resources/gpu_profiles.json (its memory and speed). Without --rig the GPUs of
this machine are planned for (free memory now; speed from the card's profile). The plan is the one
plan_auto would run: the fastest that fits (engine/placement.py predict_speed), then the longest
context. When nothing fits the command says what would (less context, a smaller KV cache, routed
experts in host RAM) and exits 1.

Part names follow the GGUF tensor names: `embed` (token embedding), `blk.N` (layer N), `blk.N.experts`
(layer N's routed experts, when they sit apart from the layer) and `head` (final norm and LM head).
`--experts-on host|auto|N` keeps MoE layers' routed experts in host RAM: all of them, as many as the
GPUs cannot hold, or all but the first N layers'; a GPU whose layers' experts are in host RAM keeps
two staging buffers for streaming them in prefill, shown apart under the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..devices import format_bytes
from ..errors import DeviceError, PlacementError
from ..placement import (
    DEFAULT_KV_TYPE,
    EXPERTS_ON_HELP,
    GLOBAL,
    HEAD,
    KV_BYTES_PER_VALUE,
    STREAMED_EXPERTS_CHUNK,
    DeviceSpec,
    MiB,
    ModelCosts,
    PlanChoice,
    check_experts_on,
    costs_for_shape,
    expert_stream_min_tokens,
    experts_auto_choices,
    experts_auto_plans,
    experts_map,
    link_of,
    plan_candidates,
)
from .run_cmd import add_cpu_weights_arg

RESERVE = 256 * MiB  # kept free on every device beyond the estimate (plan_auto's default)
# KV types from the largest to the smallest, for the "a smaller KV type would fit" advice
KV_ORDER = ("f32", "f16", "q8_0", "q3")


def register(subparsers) -> None:
    from ..models.qwen35 import SHAPES

    p = subparsers.add_parser("plan", help="will a model fit a rig, and how fast will it run (no GPU needed)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("model", nargs="?", help="a GGUF file (only its header is read)")
    p.add_argument("--shape", choices=list(SHAPES), help="price a named model shape instead of a file")
    p.add_argument("--quant", default=None, metavar="TYPE",
                   help="GGML type of the shape's matrices, e.g. q4_k, q8_0, or llama-quantize's mix q4_k_m / "
                        "q5_k_m (with --shape; default q8_0)")
    p.add_argument("--rig", default=None, metavar="SPEC",
                   help="devices, comma-separated NAME[=CAP|=CARD|=CARD/CAP][@LINK], e.g. "
                        "'cuda:0=P104-100@gen1x1,cuda:1=8GiB,cpu:0=64GiB'; default: the GPUs of this "
                        "machine with their free memory (and the host RAM as cpu:0 with --host-experts)")
    p.add_argument("--exclude", action="append", default=[], metavar="NAME",
                   help="leave a device of the rig out (repeatable), e.g. --exclude cuda:1")
    p.add_argument("--context", type=int, default=4096, help="tokens of context to plan for; default 4096")
    p.add_argument("--kv-type", default=DEFAULT_KV_TYPE, choices=list(KV_BYTES_PER_VALUE),
                   help=f"KV cache type; default {DEFAULT_KV_TYPE}")
    p.add_argument("--chunk", type=int, default=512,
                   help="prefill chunk in tokens; default 512 (at least 2048 with routed experts in host RAM "
                        "on a GPU rig, as the engine streams them)")
    p.add_argument("--experts-on", default=None, type=_experts_on, metavar="host|auto|N",
                   help=EXPERTS_ON_HELP.replace("host RAM", "host RAM (the rig's first CPU device)", 1))
    p.add_argument("--host-experts", action="store_true",
                   help="MoE: keep the routed experts on the rig's first CPU device (host RAM); the same "
                        "as --experts-on host")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="sequences held at once (minecart serve --parallel N, the app's \"Requests at once\"): "
                        "each keeps its own KV cache for the whole context and its own state; default 1")
    add_cpu_weights_arg(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..rig import Rig

    if args.context < 1:
        raise DeviceError(f"--context {args.context} is not a number of tokens; give 1 or more")
    if args.parallel < 1:
        raise DeviceError(f"--parallel {args.parallel}: give 1 or more sequences")
    devices = _devices(Rig.parse(args.rig), args.exclude) if args.rig else _present_devices(args)
    costs = _costs(args, devices)
    if costs.context_length and args.context > costs.context_length:
        raise PlacementError(f"--context {args.context} is longer than {costs.name} was trained for "
                             f"({costs.context_length} tokens); give at most {costs.context_length}")
    experts_on = "host" if args.host_experts else args.experts_on
    experts_device = ""
    experts: dict[str, str] | None = None
    if experts_on is not None:
        experts_device = _host_device(devices, costs)
        if experts_on.isdigit():  # the first N MoE layers keep theirs
            experts = experts_map(experts_on, [p.name for p in costs.parts if p.experts], experts_device)
        elif experts_on not in ("host", "auto"):
            raise DeviceError(f"--experts-on {experts_on}: plan puts routed experts in host RAM (host, "
                              f"auto or N); a device of their own is for `minecart run`")
    chunk = args.chunk
    if experts_on is not None and any(d.name.startswith("cuda") for d in devices):
        chunk = max(chunk, STREAMED_EXPERTS_CHUNK)  # as the engine runs streamed host-RAM experts
    settings = dict(context=args.context, chunk=chunk, kv_type=args.kv_type, n_sequences=args.parallel)
    choices = plan_candidates(costs, devices, reserve=RESERVE, **settings,
                              experts_device="" if experts is not None else experts_device, experts=experts)
    if experts_on == "auto":  # each split with its GPUs filled back with experts: the fastest that fits
        choices = experts_auto_choices(choices, devices, host=experts_device, reserve=RESERVE)[:1] + choices
    best = choices[0]
    advice = [] if best.fits else _advice(costs, devices, args, choices, experts_device)
    report = _report(costs, devices, best, args.context, args.kv_type, advice, args.parallel)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(_table(report))
    if not best.fits and not args.json:
        print("\n".join(["", "It does not fit. What would:"] + [f"  - {a}" for a in advice]), file=sys.stderr)
    hint = _experts_hint(costs, devices, best, settings) if experts_on is None and best.fits else None
    if hint and not args.json:
        print(hint, file=sys.stderr)
    return 0 if best.fits else 1


def _experts_hint(costs: ModelCosts, devices: list[DeviceSpec], best: PlanChoice, settings: dict) -> str | None:
    """For an MoE model whose best split puts layers on the CPU: the experts-in-host-RAM plan's speed,
    when it fits and decodes faster (the app's first plan, and `run` / `serve` over GPUs and the CPU
    without --experts-on, pick it by themselves: placement.faster_with_experts_apart)."""
    cpus = [d.name for d in devices if d.name.startswith("cpu:")]
    if not any(p.experts for p in costs.parts) or not cpus or not any(d.name.startswith("cuda") for d in devices) \
            or not any(dev.startswith("cpu:") for dev in best.plan.assignment):
        return None
    auto = experts_auto_plans(costs, devices, host=cpus[0], reserve=RESERVE, **settings)[0]
    if not auto.fits or auto.speed.decode_tokens_per_s <= best.speed.decode_tokens_per_s:
        return None
    return (f"\nfaster: --experts-on auto (every layer on the GPUs, the routed experts that do not fit there "
            f"in host RAM): decode {auto.speed.decode_tokens_per_s:.1f} tokens/s, "
            f"{auto.speed.decode_tokens_per_s / best.speed.decode_tokens_per_s:.1f}x this plan's; run and serve "
            f"given these devices without --experts-on take it by themselves")


# ---- inputs -------------------------------------------------------------------------------------------


def _devices(rig, exclude: list[str]) -> list[DeviceSpec]:
    names = rig.names
    for name in exclude:
        if name not in names:
            raise DeviceError(f"--exclude {name}: the rig has no such device ({', '.join(names)})")
    specs = [d for d in rig.device_specs() if d.name not in exclude]
    if not specs:
        raise DeviceError("every device of the rig is excluded; leave at least one")
    for d, dev in zip(specs, [rig.device(s.name) for s in specs], strict=True):
        if dev.memory_cap is None:
            raise DeviceError(f"{d.name} has no memory size; give one or a card, e.g. {d.name}=8GiB or "
                              f"{d.name}=P104-100")
    return specs


def _present_devices(args) -> list[DeviceSpec]:
    """The GPUs of this machine: free memory now, speed and link from the card's profile when its name
    has one (resources/gpu_profiles.json); the host RAM as cpu:0 with --host-experts."""
    from .. import devices as devices_mod
    from ..rig import device_spec

    found = devices_mod.list_devices(include_cpu=args.host_experts, with_probe=False)
    ids = [i.id for i in found]
    for name in args.exclude:
        if name not in ids:
            raise DeviceError(f"--exclude {name}: this machine has no such device ({', '.join(ids) or 'none'})")
    out = []
    for info in found:
        if info.id in args.exclude:
            continue
        if info.free_bytes <= 0:
            raise DeviceError(f"{info.id} ({info.name}) does not report its free memory; describe the rig "
                              f"with --rig (e.g. --rig {info.id}=8GiB)")
        out.append(device_spec(info))
    if not any(d.name.startswith("cuda:") for d in out):
        raise DeviceError("no GPU found on this machine (or every one is excluded); describe the rig to plan "
                          "for with --rig, e.g. --rig cuda:0=P104-100,cuda:1=8GiB")
    return out


def _costs(args, devices: list[DeviceSpec]) -> ModelCosts:
    if args.shape:
        if args.model:
            raise DeviceError("give a GGUF file or --shape, not both")
        if all(d.name.startswith("cpu:") for d in devices):
            raise DeviceError("--shape prices the CUDA backend's weights; put at least one cuda device in the rig")
        return costs_for_shape(args.shape, (args.quant or "q8_0").upper())
    if not args.model:
        raise DeviceError("give a GGUF file, or --shape NAME --quant TYPE to price a model without its file")
    if args.quant:
        raise DeviceError("--quant goes with --shape; a file's types are its own")
    from ..execution import costs_for_devices
    from ..model import open_model_file

    gf, config = open_model_file(args.model)
    try:  # as load_model will hold them (float32 on the CPU alone unless they would not fit in RAM)
        return costs_for_devices(config, gf, [d.name for d in devices], args.cpu_weights)
    finally:
        gf.close()


def _experts_on(text: str) -> str:
    try:
        return check_experts_on(text)
    except PlacementError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_device(devices: list[DeviceSpec], costs: ModelCosts) -> str:
    if not any(p.experts for p in costs.parts):
        raise DeviceError(f"--experts-on / --host-experts: {costs.name} has no routed experts (it is not "
                          f"a MoE model)")
    cpus = [d.name for d in devices if d.name.startswith("cpu:")]
    if not cpus:
        raise DeviceError("routed experts in host RAM need the host's RAM in the rig: add e.g. cpu:0=64GiB "
                          "to --rig")
    return cpus[0]


# ---- advice when nothing fits ----------------------------------------------------------------------------


def _advice(costs: ModelCosts, devices: list[DeviceSpec], args, choices: list[PlanChoice],
            experts_device: str) -> list[str]:
    out: list[str] = []
    n = args.parallel
    longest = max(c.max_context for c in choices)
    if longest >= 1:
        each = f" for each of {n} sequences" if n > 1 else ""
        out.append(f"less context: up to {longest} tokens fit{each} with a {args.kv_type} KV cache "
                   f"(--context {longest})")
    for fewer in range(n - 1, 0, -1):  # the most sequences at once that fit this context
        c = plan_candidates(costs, devices, context=args.context, chunk=args.chunk, kv_type=args.kv_type,
                            reserve=RESERVE, n_sequences=fewer, experts_device=experts_device)
        if c[0].fits:
            out.append(f"fewer sequences at once: --parallel {fewer} fits {args.context} tokens"
                       f"{' each' if fewer > 1 else ''}")
            break
    smaller = KV_ORDER[KV_ORDER.index(args.kv_type) + 1:] if args.kv_type in KV_ORDER else ()
    for kv in smaller:
        c = plan_candidates(costs, devices, context=args.context, chunk=args.chunk, kv_type=kv, reserve=RESERVE,
                            n_sequences=n, experts_device=experts_device)
        if c[0].fits:
            out.append(f"a smaller KV cache: --kv-type {kv} fits {args.context} tokens "
                       f"(up to {c[0].max_context})")
            break
    if not experts_device and any(p.experts for p in costs.parts):
        cpus = [d for d in devices if d.name.startswith("cpu:")]
        expert_bytes = sum(p.expert_bytes for p in costs.parts)
        if cpus:
            c = plan_candidates(costs, devices, context=args.context, chunk=args.chunk, kv_type=args.kv_type,
                                reserve=RESERVE, n_sequences=n, experts_device=cpus[0].name)
            if c[0].fits:
                out.append(f"routed experts in host RAM: --host-experts fits ({format_bytes(expert_bytes)} of "
                           f"experts on {cpus[0].name}, decode about {c[0].speed.decode_tokens_per_s:.1f} tokens/s)")
        else:
            out.append(f"routed experts in host RAM: add the host to the rig (cpu:0=...GiB, the experts take "
                       f"{format_bytes(expert_bytes)}) and pass --host-experts")
    best = choices[0]
    short = sum(max(0, b.total + RESERVE - next((d.free_bytes for d in devices if d.name == dev), 0))
                for dev, b in best.plan.bytes_per_device().items())
    if not out:
        out.append(f"more memory: the closest plan is {format_bytes(short)} short; add a card or use a "
                   f"smaller quantization of the model")
    return out


# ---- output -------------------------------------------------------------------------------------------


def part_label(name: str) -> str:
    """The engine's part name as the plan shows it: global -> embed, layer.N -> blk.N, head."""
    if name == GLOBAL:
        return "embed"
    if name == HEAD:
        return "head"
    return "blk." + name.split(".", 1)[1]


def kv_bytes_per_token(costs: ModelCosts, kv_type: str) -> int:
    """KV cache bytes one token adds over every attention layer (what the backends allocate)."""
    return int(round(sum(p.kv_values_per_token for p in costs.parts) * KV_BYTES_PER_VALUE[kv_type]))


def _report(costs: ModelCosts, devices: list[DeviceSpec], choice: PlanChoice, context: int, kv_type: str,
            advice: list[str], parallel: int = 1) -> dict[str, Any]:
    plan = choice.plan
    per = plan.bytes_per_device()
    by_name = {d.name: d for d in devices}
    rows = []
    for d in devices:
        parts = [part_label(p) for p in plan.parts_on(d.name)]
        parts += [f"{part_label(p)}.experts" for p, dev in plan.experts_apart().items() if dev == d.name]
        b = per.get(d.name)
        rows.append({
            "name": d.name, "capacity_bytes": int(by_name[d.name].free_bytes),
            "planned_bytes": int(b.total) if b else 0, "parts": parts,
            "card": d.speed.name if d.speed else "", "label": d.label, "link": d.link.name if d.link else "",
            "weights_bytes": b.weights if b else 0, "kv_cache_bytes": b.kv_cache if b else 0,
            "other_bytes": (b.total - b.weights - b.kv_cache) if b else 0,
            # of other_bytes: the two buffers host-held experts are streamed into for prefill
            "expert_staging_bytes": b.expert_staging if b else 0,
            # of other_bytes on a host: the page-locked copy of the experts it holds for GPU layers
            "pinned_bytes": b.pinned if b else 0,
            # of other_bytes on a GPU: the weight arenas' bytes beyond the weights (each part's arrays in
            # one allocation of whole 2 MiB pages: placement._arena_padding)
            "rounding_bytes": b.rounding if b else 0,
            # a GPU with host-RAM experts: the fewest tokens of a prefill run for which its link copies a
            # layer's experts sooner than the CPU's kernels run the run's tokens (the runtime's rule)
            "expert_stream_min_tokens": expert_stream_min_tokens(plan, d.name, devices),
            "link_name": link_of(d).name,
            "decode_seconds_per_token": choice.speed.per_device.get(d.name, 0.0),
        })
    return {
        "fits": bool(choice.fits),
        "context": int(context),
        "kv_type": kv_type,
        "parallel": int(parallel),  # sequences held at once, each with the whole context
        "chunk": int(plan.chunk),  # prefill run, tokens
        "devices": rows,
        "predicted": {"decode_tokens_per_s": round(choice.speed.decode_tokens_per_s, 2),
                      "prefill_tokens_per_s": round(choice.speed.prefill_tokens_per_s, 1),
                      "decode_tokens_per_s_at_context": round(choice.speed.decode_at_context_tokens_per_s, 2),
                      "prefill_prompt_tokens": choice.speed.prompt},
        "model": costs.name, "source": costs.source,
        "kv_bytes_per_token": kv_bytes_per_token(costs, kv_type),
        # MoE layers whose routed experts sit apart from the layer: blk.N -> device
        "experts": {part_label(p): dev for p, dev in plan.experts_apart().items()},
        "max_context": int(choice.max_context),
        "reserve_bytes": RESERVE,
        "suggestions": advice,
    }


def _runs(labels: list[str]) -> str:
    """"embed, blk.0 ... blk.31, head" -> "embed, blk.0-31, head"."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"blk.{run[0]}" if len(run) == 1 else f"blk.{run[0]}-{run[-1]}")
            run.clear()

    for label in labels:
        if label.startswith("blk.") and label.count(".") == 1:
            i = int(label[4:])
            if run and i != run[-1] + 1:
                flush()
            run.append(i)
        else:
            flush()
            out.append(label)
    flush()
    experts = [x for x in out if x.endswith(".experts")]
    if len(experts) > 1:  # the experts of many layers: one entry
        out = [x for x in out if not x.endswith(".experts")] + [f"experts of {len(experts)} layers"]
    return ", ".join(out) or "-"


def _table(r: dict[str, Any]) -> str:
    each = f" for each of {r['parallel']} sequences at once" if r["parallel"] > 1 else ""
    head = (f"{r['model']} at {r['context']} tokens of context{each}, {r['kv_type']} KV cache "
            f"({format_bytes(r['kv_bytes_per_token'])} per token): {'fits' if r['fits'] else 'DOES NOT FIT'}")
    lines = [head, ""]
    cols = ("device", "card", "capacity", "planned", "weights", "KV cache", "other", "parts")
    rows = [[d["name"], d["card"] or "-", format_bytes(d["capacity_bytes"]),
             format_bytes(d["planned_bytes"]) if d["planned_bytes"] else "-", format_bytes(d["weights_bytes"]),
             format_bytes(d["kv_cache_bytes"]), format_bytes(d["other_bytes"]), _runs(d["parts"])]
            for d in r["devices"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    for d in r["devices"]:
        if d["expert_staging_bytes"]:
            lines.append(f"{d['name']}: {format_bytes(d['expert_staging_bytes'])} of 'other' are the two "
                         f"buffers that host-RAM experts are streamed into for prefill")
        if d["pinned_bytes"]:
            lines.append(f"{d['name']}: {format_bytes(d['pinned_bytes'])} of 'other' are the page-locked copy of "
                         f"its experts that prefill streams from (the CPU's decode reads the file's pages)")
        n = d["expert_stream_min_tokens"]
        if n is not None:
            how = ("are streamed to it" if r["chunk"] >= n else
                   "stay on the CPU, one token after another on its integer kernels")
            lines.append(f"{d['name']}: in prefill runs of {r['chunk']:,} tokens its host-RAM experts {how} "
                         f"(over {d['link_name']} streaming wins from {n:,} tokens)")
    p = r["predicted"]
    lines += ["", f"predicted: decode {p['decode_tokens_per_s']:.1f} tokens/s (empty context), "
              f"{p['decode_tokens_per_s_at_context']:.1f} at {r['context']} tokens; prefill "
              f"{p['prefill_tokens_per_s']:.0f} tokens/s ({p['prefill_prompt_tokens']}-token prompt)",
              f"longest context this split fits: {r['max_context']} tokens "
              f"(each device keeps {format_bytes(r['reserve_bytes'])} free beyond the estimate)"]
    return "\n".join(lines)
