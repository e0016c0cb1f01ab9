"""`minecart inspect`: what a GGUF file holds, without loading its weights.

    minecart inspect MODEL.gguf [--json] [--layers] [--gpu]

Prints architecture, name, parameter counts (with and without the embeddings; MTP blocks apart), the
quantization mix (type: tensors, bytes), file size, context length, layer kinds, bytes per layer, head
and Gated DeltaNet dims, MoE sizes, the tokenizer, and whether every tensor the architecture needs is
present with the right shape. Two kinds of file that are not a runnable model are told for what they
are: a vision projector (mmproj: the picture encoder of a vision model, with its tower's shape and how
to use it) and a vocabulary-only file (a tokenizer and hyper-parameters without weights). `--gpu` lists the compute devices. Only the header and metadata are read
(the tensors stay in the memory map), so this is instant even for a 30 GB file.

`describe_model(gguf_file)` returns the same facts as a dict (the `--json` output) for other callers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..gguf_file import GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_KIND_LABEL = {"gdn": "GDN", "attention": "attention", "sliding": "sliding window"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="show what a GGUF model file holds",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="the GGUF file")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--layers", action="store_true", help="print every layer's size (default: a summary)")
    p.add_argument("--gpu", action="store_true", help="also list the compute devices minecart sees")
    p.set_defaults(func=run)


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: int | float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def _layer_summary(kinds: Iterable[str]) -> str:
    counts = Counter(kinds)
    order = [k for k in ("gdn", "attention", "sliding") if k in counts] + sorted(set(counts) - set(_KIND_LABEL))
    return ", ".join(f"{_KIND_LABEL.get(k, k)} x{counts[k]}" for k in order)


def describe_model(gf: GGUFFile) -> dict[str, Any]:
    """Facts about an opened GGUFFile as plain JSON-able data."""
    from ..config import ModelConfig, validate_tensors
    from ..errors import MinecartError

    arch = str(gf.get("general.architecture", "?"))
    facts: dict[str, Any] = {
        "path": str(gf.path),
        "file_bytes": int(gf.file_size),
        "gguf_version": gf.version,
        "n_metadata_keys": len(gf.metadata),
        "n_tensors": len(gf.tensors),
        "architecture": arch,
        "name": gf.get("general.name"),
        "file_type": gf.get("general.file_type"),
    }
    config, config_error = None, None
    if arch == "clip":
        facts["mmproj"] = _describe_mmproj(gf)
    else:
        try:
            # ignore: models/spec.GGUFLike declares `tensors` a writable Mapping attribute, which
            # GGUFFile's dict cannot match (a read-only property there would)
            config = ModelConfig.from_gguf(gf)  # type: ignore[arg-type]
        except MinecartError as exc:
            config_error = str(exc)
    facts["supported"] = config is not None
    if config_error:
        facts["config_error"] = config_error

    n_main = config.n_layers if config else None
    total = embed = mtp = 0
    mix: dict[str, dict[str, int]] = {}
    per_layer: dict[int, dict[str, Any]] = {}
    for t in gf.tensors.values():
        n = t.n_elements
        m = _BLOCK.match(t.name)
        layer = int(m.group(1)) if m else None
        entry = mix.setdefault(t.type_name, {"tensors": 0, "bytes": 0, "params": 0})
        entry["tensors"] += 1
        entry["bytes"] += int(t.n_bytes)
        entry["params"] += n
        if layer is not None and n_main is not None and layer >= n_main:
            mtp += n
            continue
        total += n
        if t.name in ("token_embd.weight", "output.weight"):
            embed += n
        if layer is not None:
            row = per_layer.setdefault(layer, {"layer": layer, "bytes": 0, "params": 0})
            row["bytes"] += int(t.n_bytes)
            row["params"] += n
    facts["params"] = {"total": total, "excluding_embeddings": total - embed, "embeddings": embed,
                       "mtp": mtp}
    facts["tensor_bytes"] = sum(int(t.n_bytes) for t in gf.tensors.values())
    facts["quant_mix"] = dict(sorted(mix.items(), key=lambda kv: -kv[1]["bytes"]))

    if config is not None:
        c = config
        facts["context_length"] = c.context_length
        facts["hidden"] = c.hidden
        facts["n_layers"] = c.n_layers
        facts["n_mtp_layers"] = c.n_mtp_layers
        facts["layer_types"] = list(c.layer_types)
        facts["layer_summary"] = _layer_summary(c.layer_types)
        for row in per_layer.values():
            if row["layer"] < c.n_layers:
                row["kind"] = c.layer_types[row["layer"]]
        facts["layers"] = [per_layer[i] for i in sorted(per_layer) if i < c.n_layers]
        by_kind: dict[str, list[int]] = {}
        for row in facts["layers"]:
            by_kind.setdefault(row.get("kind", "?"), []).append(row["bytes"])
        facts["bytes_per_layer_kind"] = {k: {"layers": len(v), "min": min(v), "max": max(v)}
                                         for k, v in by_kind.items()}
        facts["attention"] = {"heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                              "value_head_dim": c.value_head_dim, "rope_dims": c.rope_dims,
                              "rope_base": c.rope_base, "rms_eps": c.rms_eps}
        if c.sliding_window:
            facts["attention"]["sliding_window"] = c.sliding_window
        if c.gdn_v_heads:
            facts["gdn"] = {"key_heads": c.gdn_k_heads, "value_heads": c.gdn_v_heads,
                            "key_dim": c.gdn_key_dim, "value_dim": c.gdn_value_dim,
                            "conv_kernel": c.conv_kernel, "conv_channels": c.gdn_conv_dim}
        if c.ffn:
            facts["ffn"] = c.ffn
        if c.is_moe:
            fused = any(n.endswith("ffn_gate_up_exps.weight") for n in gf.tensors)
            facts["moe"] = {"experts": c.n_experts, "experts_used": c.n_experts_used,
                            "expert_ffn": c.expert_ffn, "shared_expert_ffn": c.shared_expert_ffn,
                            "gate_up": "fused" if fused else "separate"}
        facts["tied_embeddings"] = c.tied_embeddings
        facts["vocab_size"] = c.vocab_size
        if not gf.tensors:
            facts["vocab_only"] = True
        try:
            if not gf.tensors:
                pass  # a vocabulary-only file (convert_hf_to_gguf.py --vocab-only): nothing to check
            else:
                validate_tensors(c, gf)  # type: ignore[arg-type]  # see ModelConfig.from_gguf above
                facts["tensors_ok"] = True
        except MinecartError as exc:
            facts["tensors_ok"] = False
            facts["tensor_error"] = str(exc)

    tokens = gf.get("tokenizer.ggml.tokens")
    facts["tokenizer"] = {
        "model": gf.get("tokenizer.ggml.model"),
        "pre": gf.get("tokenizer.ggml.pre"),
        "tokens": len(tokens) if tokens is not None else 0,
        "merges": len(gf.get("tokenizer.ggml.merges") or ()),
        "bos_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_id": gf.get("tokenizer.ggml.eos_token_id"),
        "has_chat_template": bool(gf.get("tokenizer.chat_template")),
    }
    return facts


def _describe_mmproj(gf: GGUFFile) -> dict[str, Any]:
    """A vision projector's tower, from its clip.* keys (or why they cannot be read)."""
    from ..errors import MinecartError
    from ..vision.mmproj import VisionConfig

    try:
        vc = VisionConfig.from_gguf(gf)
    except MinecartError as exc:
        return {"error": str(exc)}
    return {"projector_type": vc.projector_type, "blocks": vc.n_layers, "hidden": vc.hidden,
            "heads": vc.n_heads, "patch_size": vc.patch_size, "merge_size": vc.merge_size,
            "output_width": vc.projection_dim}


def _print_facts(f: dict[str, Any], all_layers: bool, out: IO[str]) -> None:
    def w(label: str, value: object) -> None:
        print(f"{label + ':':22s}{value}", file=out)

    w("file", f"{f['path']} ({format_bytes(f['file_bytes'])}, GGUF v{f['gguf_version']}, "
      f"{f['n_tensors']} tensors, {f['n_metadata_keys']} metadata keys)")
    note = ""
    if f["architecture"] == "clip":
        note = "  (a vision projector (mmproj): the picture encoder of a vision model, not a language model)"
    elif not f["supported"]:
        note = "  (not runnable by minecart)"
    elif f.get("vocab_only"):
        note = "  (vocabulary-only file: tokenizer and hyper-parameters, no weights)"
    w("architecture", f["architecture"] + note)
    if "mmproj" in f:
        m = f["mmproj"]
        if "error" in m:
            w("vision tower", m["error"])
        else:
            w("vision tower", f"{m['projector_type']}: {m['blocks']} blocks {m['hidden']} wide, "
              f"{m['heads']} heads, {m['patch_size']}-pixel patches merged {m['merge_size']}x"
              f"{m['merge_size']}; output rows {m['output_width']} wide (the language model's hidden size)")
        w("use", f"with its language model: minecart run MODEL.gguf --mmproj {f['path']} --image "
          "PICTURE (an mmproj-*.gguf beside the model is found without --mmproj)")
    if f.get("vocab_only"):
        w("use", "tokenizer tests (convert_hf_to_gguf.py --vocab-only writes such files); minecart "
          "cannot generate with it: run the model's full GGUF")
    w("name", f["name"])
    p = f["params"]
    params = f"{format_count(p['total'])} ({format_count(p['excluding_embeddings'])} without embeddings)"
    if p["mtp"]:
        params += f", +{format_count(p['mtp'])} in MTP blocks"
    w("parameters", params)
    if "context_length" in f:
        w("context length", f"{f['context_length']:,}")
        w("layers", f"{f['n_layers']}: {f['layer_summary']}"
          + (f" (+{f['n_mtp_layers']} MTP block)" if f["n_mtp_layers"] else ""))
        a = f["attention"]
        w("attention", f"{a['heads']} heads / {a['kv_heads']} KV heads, head dim {a['head_dim']}, "
          f"RoPE on {a['rope_dims']} dims (base {a['rope_base']:g})"
          + (f", sliding window {a['sliding_window']}" if "sliding_window" in a else ""))
        if "gdn" in f:
            g = f["gdn"]
            w("gated deltanet", f"{g['key_heads']} key heads x {g['key_dim']}, {g['value_heads']} value "
              f"heads x {g['value_dim']}, conv kernel {g['conv_kernel']} over {g['conv_channels']} channels")
        if "moe" in f:
            m = f["moe"]
            w("moe", f"{m['experts']} experts, top-{m['experts_used']}, expert width {m['expert_ffn']}, "
              f"shared expert {m['shared_expert_ffn']}, gate/up {m['gate_up']}")
        elif "ffn" in f:
            w("ffn", f"width {f['ffn']}")
        w("hidden size", f"{f['hidden']}, embeddings {'tied' if f['tied_embeddings'] else 'untied'}, "
          f"vocabulary rows {f['vocab_size']:,}")
    elif "config_error" in f:
        w("model config", f["config_error"])
    t = f["tokenizer"]
    if t["model"]:
        w("tokenizer", f"{t['model']} (pre '{t['pre']}'), {t['tokens']:,} tokens, {t['merges']:,} merges, "
          f"eos {t['eos_id']}, chat template {'yes' if t['has_chat_template'] else 'no'}")
    else:
        w("tokenizer", "none")
    if f["quant_mix"]:
        print("quantization mix:", file=out)
    for name, m in f["quant_mix"].items():
        print(f"  {name:8s} {m['tensors']:5d} tensors  {format_bytes(m['bytes']):>11s}  "
              f"{format_count(m['params']):>9s} params", file=out)
    if f.get("layers"):
        if all_layers:
            print("bytes per layer:", file=out)
            for row in f["layers"]:
                print(f"  {row['layer']:4d}  {_KIND_LABEL.get(row.get('kind'), '?'):15s}"
                      f"{format_bytes(row['bytes']):>12s}  {format_count(row['params']):>9s} params", file=out)
        else:
            print("bytes per layer (--layers for each):", file=out)
            for kind, s in f["bytes_per_layer_kind"].items():
                size = format_bytes(s["min"]) if s["min"] == s["max"] else \
                    f"{format_bytes(s['min'])} - {format_bytes(s['max'])}"
                print(f"  {_KIND_LABEL.get(kind, kind):15s} x{s['layers']:<4d} {size:>12s} each", file=out)
    if "tensors_ok" in f:
        w("tensors", "all present with the shapes the metadata implies" if f["tensors_ok"]
          else f"PROBLEM: {f['tensor_error']}")


def _device_lines() -> list[str]:
    import importlib

    try:  # a teammate's module; builds without it still inspect files
        devices = importlib.import_module("minecart.engine.devices")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith("devices"):
            return ["no device module in this build (minecart.engine.devices is missing)"]
        raise
    return list(devices.describe_devices())


def run(args: argparse.Namespace) -> int:
    from ..errors import RequestError
    from ..gguf_file import GGUFFile

    if not args.model and not args.gpu:
        raise RequestError("inspect needs a GGUF file (or --gpu to list devices)")
    result: dict[str, Any] = {}
    if args.model:
        with GGUFFile(args.model) as gf:
            result = describe_model(gf)
    if args.gpu:
        result["devices"] = _device_lines()
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
        return 0
    if args.model:
        _print_facts(result, args.layers, sys.stdout)
    if args.gpu:
        print("devices:")
        for line in result["devices"]:
            print(f"  {line}")
    return 0
