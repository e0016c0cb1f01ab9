"""`minecart synth`: write a GGUF with random weights and the real shape and metadata of a named model.

    minecart synth --shape qwen3.5-9b --quant q8_0 /tmp/9b-q8.gguf
    minecart synth --shape tiny-moe --quant q4_k --layers 2 /tmp/tiny-moe.gguf
    minecart synth --list

The file streams to disk tensor by tensor (engine/synth.py); the command prints its size and the
throughput. The weights are noise: use these files for speed, memory and loader tests, not for text.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..quant_mix import QUANT_NAMES
    from ..synth import SHAPES

    p = subparsers.add_parser("synth", help="write a random-weight GGUF with a real model's shape",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="the GGUF file to write")
    p.add_argument("--shape", choices=list(SHAPES), help="model shape to imitate")
    p.add_argument("--quant", default="q8_0", choices=QUANT_NAMES,
                   help="type of the matrices (small tensors stay F32), or q4_k_m / q5_k_m: llama-quantize's "
                        "mixes of those names (Q6_K output, some attn_v / attn_qkv / ffn_down); default q8_0")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same file); default 0")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N main layers")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")
    p.add_argument("--fuse-gate-up", action="store_true",
                   help="MoE: write fused ffn_gate_up_exps instead of separate gate/up expert tensors")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument("--tower", default=None, metavar="NAME",
                   help="write a vision projector (mmproj) of this model's tower instead of a model, "
                        "e.g. qwen3.5-27b; --quant f32, f16, bf16 or q8_0 (engine/vision/synth_mmproj.py)")
    p.set_defaults(func=run)


class _Progress:
    """A one-line progress meter on stderr, redrawn at most twice a second."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.line_open = False  # a meter line waits for its newline
        self.tty = sys.stderr.isatty()  # a log file gets no carriage-return redraws

    def __call__(self, done: int, total: int) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if now - self.last < 0.5 and done < total:
            return
        self.last = now
        rate = done / 1e6 / max(now - self.t0, 1e-9)
        print(f"\r  {done / 1e9:7.2f} / {total / 1e9:.2f} GB of tensor data, {rate:6.0f} MB/s",
              end="", file=sys.stderr, flush=True)
        self.line_open = True

    def end(self) -> None:
        """Close the meter line (the writer may report `total` more than once, or never)."""
        if self.line_open:
            print(file=sys.stderr, flush=True)
            self.line_open = False


def run(args: argparse.Namespace) -> int:
    from ..errors import RequestError
    from ..synth import SHAPES, write_synthetic

    if args.list:
        for s in SHAPES.values():
            ffn = (f"MoE {s.n_experts} experts top-{s.n_experts_used}, width {s.expert_ffn}, shared "
                   f"{s.shared_expert_ffn}" if s.n_experts else f"FFN {s.ffn}")
            print(f"{s.name:17s} {s.arch:9s} H {s.hidden}, {s.n_layers} layers, heads {s.n_heads}/"
                  f"{s.n_kv_heads}, GDN {s.gdn_k_heads}/{s.gdn_v_heads}, {ffn}, "
                  f"{'tied' if s.tied else 'untied'} embeddings")
        return 0
    if args.seed < 0:  # NumPy's generators take only non-negative seeds
        raise RequestError(f"--seed must be an integer >= 0, got {args.seed}")
    if args.tower:
        return _run_tower(args)
    if not args.shape or not args.out:
        raise RequestError("synth needs --shape NAME and an output path (see `minecart synth --list`)")
    print(f"writing {args.out}: {args.shape}, {args.quant}, seed {args.seed}"
          + (f", {args.layers} layers" if args.layers is not None else ""), file=sys.stderr)
    return _write(args.out, lambda progress: write_synthetic(
        args.out, args.shape, args.quant, seed=args.seed, n_layers=args.layers, mtp=not args.no_mtp,
        fuse_gate_up=args.fuse_gate_up, progress=progress))


def _run_tower(args: argparse.Namespace) -> int:
    from ..errors import RequestError
    from ..vision.synth_mmproj import write_synthetic_mmproj

    if not args.out:
        raise RequestError("synth --tower needs an output path, e.g. /tmp/mmproj-27b-f16.gguf")
    quant = args.quant  # matrices; rows that do not split into blocks fall back to F16
    print(f"writing {args.out}: {args.tower} vision tower, {quant}, seed {args.seed}", file=sys.stderr)
    return _write(args.out, lambda progress: write_synthetic_mmproj(args.out, args.tower, quant, seed=args.seed,
                                                                    progress=progress))


def _write(out: str, write: Callable[[_Progress], dict]) -> int:
    """Run a synthesizer `write(progress)` with a progress meter and print what it wrote; a file that
    cannot be written is a RequestError."""
    from ..errors import RequestError

    progress = _Progress()
    try:
        info = write(progress)
    except OSError as exc:
        raise RequestError(f"cannot write {out}: {exc}; check the folder and free disk space") from exc
    finally:
        progress.end()
    print(f"wrote {info['path']}: {info['bytes'] / 1e9:.3f} GB, {info['tensors']} tensors in "
          f"{info['seconds']:.1f} s ({info['mb_per_s']:.0f} MB/s)")
    return 0
