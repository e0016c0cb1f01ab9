"""Predicted against measured tokens/s of split plans: the speed model (engine/placement.py
predict_speed) beside `minecart bench --devices ... --json`.

    minecart bench --shape qwen3.5-9b --quant q4_k --devices cuda:0,cuda:1,cuda:2 --json > split.json
    python tools/plan_vs_measured.py split.json --shape qwen3.5-9b --quant q4_k --card H200

For every row of the benchmark (1, 2, 3 ... logical devices, with and without a simulated link) the
plan is the one the engine ran: plan_auto over the rig's devices (engine/rig.py Rig.parse of the row's
description, as `minecart bench` loads it), priced on paper for the shape (costs_for_shape equals the
synthesized file's costs). Each device is given the card's profile (resources/gpu_profiles.json) and
the row's link. Logical devices that share one GPU cannot overlap their prefill compute, so their
prefill is compared with that prediction (prefill_one_gpu), and the logits row's copy
to the host is left out of the prediction because the emulated links do not charge it in graph decode
(engine/execution.py charges the hidden-state buffers only; a real riser would carry the ~1 MB row).
The output is a markdown table for docs/BENCHMARKS.md: measured, predicted, measured / predicted.

What this is not: a benchmark (it reads one) or a calibration (the efficiencies live in placement.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from minecart.engine import gpu_profiles
from minecart.engine.placement import DeviceSpec, costs_for_shape, plan_auto, predict_speed
from minecart.engine.rig import Rig


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="the JSON of `minecart bench --devices ... --json`")
    p.add_argument("--shape", required=True, help="the shape the benchmark synthesized, e.g. qwen3.5-9b")
    p.add_argument("--quant", default="q8_0", help="its quant type (default q8_0)")
    p.add_argument("--card", default="H200", help="the card profile the benchmark ran on (default H200)")
    p.add_argument("--kv-type", default="f32", help="the KV cache type the benchmark ran with (default f32)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    rows = compare(report, args.shape, args.quant, args.card, args.kv_type)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    worst = max(max(abs(r["prefill_ratio"] - 1), abs(r["decode_ratio"] - 1)) for r in rows)
    print(f"largest miss: {100 * worst:.0f}% (target: within 15%)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
