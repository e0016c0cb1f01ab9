"""`minecart run`: load a model, answer one prompt, stream the answer to stdout, print the speeds.

Thinking text goes to stdout dimmed when stdout is a terminal, else to stderr (so `minecart run ... >
answer.txt` keeps only the answer); `--hide-thinking` drops it. Load progress and the closing line
("prompt: N tokens, X tok/s | generation: M tokens, Y tok/s") go to stderr.

This module also holds what `chat` and `serve` share: the model/sampling/device flags, model loading
through a Runtime with a progress line, and the streaming printer. It never imports Qt.
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ImageError, PlacementError, RequestError
from ..json_output import JsonFormat, SchemaError, json_object_format, json_schema_format
from ..kvquant import DEFAULT_KV_TYPE, KV_TYPES
from ..model import check_model_file
from ..placement import CPU_WEIGHTS, EXPERTS_ON_HELP, check_experts_on
from ..prompt import PROMPT_MODES
from ..runtime import RequestHandle, Runtime, RuntimeEvent
from ..sampling import DEFAULT_MAX_TOKENS_CHAT, DEFAULT_MAX_TOKENS_TEXT, SamplingParams

DIM = "\x1b[2m"
RESET = "\x1b[0m"
IMAGE_MAX_BYTES = 32 * 2**20


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def experts_on_arg(text: str) -> str:
    """argparse type of --experts-on: host, auto, N or a device (placement.check_experts_on)."""
    try:
        return check_experts_on(text)
    except PlacementError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for matrix products (BLAS) and for the routed experts run on "
                        "the CPU when they sit in host RAM (default: chosen for this machine: 1 "
                        "up to 4 cores, else half of them, at most 8; OPENBLAS_NUM_THREADS / "
                        "OMP_NUM_THREADS in the environment are kept for BLAS)")


def add_cpu_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-weights", default="stored", choices=CPU_WEIGHTS,
                   help="how a model on the CPU alone holds its weights: stored (default: as the file "
                        "stores them, multiplied on int8 activations as llama.cpp does; 3-6x less RAM "
                        "and ~3x the decode speed; F16 and BF16 stay float32) or float32 (decoded "
                        "copies: the exact reference). Beside a "
                        "GPU the CPU's layers are always held as stored")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="path of a GGUF file (default: the Gemma 3 270M demo model from the `demo` extra)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="comma-separated devices to spread the layers over, e.g. cuda:0,cuda:1 or cpu "
                        "(default: the first GPU, else the CPU)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="vision projector GGUF for pictures (default: an mmproj-*.gguf beside the model "
                        "that fits it)")
    p.add_argument("--max-image-tokens", type=int, default=None, metavar="N",
                   help="cap on image tokens per picture, one per 32x32 pixels; bigger pictures are "
                        "scaled down (default: 1024, about one megapixel)")
    p.add_argument("--kv-type", default=DEFAULT_KV_TYPE, choices=KV_TYPES,
                   help="KV cache type: f16 (default, half of f32), q8_0 (a quarter, plus scales), q3 "
                        "(3-bit Walsh-Hadamard + Lloyd-Max codes, ~9x smaller than f32) or f32 (exact)")
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="context limit in tokens, prompt and answer together: sessions are allocated "
                        "for it and a longer prompt is refused (default: 4096; at most the model's "
                        "trained context)")
    p.add_argument("--experts-on", default=None, type=experts_on_arg, metavar="host|auto|N",
                   help=EXPERTS_ON_HELP)
    add_cpu_weights_arg(p)
    add_threads_arg(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    p.add_argument("--chat-template", default="auto", choices=PROMPT_MODES,
                   help="on: wrap messages in the model's chat template; off: send their plain text "
                        "for the model to continue; auto (default): off for a pretrained base model "
                        "(no chat template in its file), on otherwise")
    p.add_argument("--no-think", action="store_true",
                   help="turn thinking off (the chat template's enable_thinking=false)")
    p.add_argument("--hide-thinking", action="store_true", help="do not print the thinking text")
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=None, metavar="T",
                   help="sampling temperature, 0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K likeliest tokens, 0 = off (default: 20)")
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="drop tokens below P times the top probability, 0 = off (default: 0)")
    p.add_argument("--repeat-penalty", type=float, default=None, metavar="R",
                   help="repetition penalty over prompt and output, 1 = off (default: 1)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help=f"stop after N generated tokens (default: {DEFAULT_MAX_TOKENS_CHAT} for a chat "
                        f"answer, which may think first; {DEFAULT_MAX_TOKENS_TEXT} for plain text)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="random seed, for repeatable sampling")
    p.add_argument("--json", action="store_true",
                   help="answer with a JSON object (only tokens that keep the answer JSON are drawn)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answer with JSON of the JSON Schema in FILE (the keywords engine/json_output.py "
                        "holds answers to; others are refused)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="answer one prompt and print the speeds",
        description="Load a model, answer one prompt (streamed to stdout) and print prompt and "
                    "generation tokens/s to stderr.",
    )
    add_model_args(p)
    p.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT",
                   help="the user message, after MODEL (or give it with -p)")
    p.add_argument("-p", "--prompt", default=None,
                   help="the user message (default: PROMPT, else stdin when it is not a terminal)")
    add_sampling_args(p)
    p.add_argument("--image", action="append", default=[], metavar="PIC",
                   help="attach a picture to the prompt (repeatable; vision models only)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as raw text to continue (a plain completion; like "
                        "--chat-template off, without --system or --image)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------------
# shared helpers


def model_path(arg: str | None) -> str:
    if arg:
        path = Path(arg).expanduser()
        if path.is_dir():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))[:3]
            hint = f" such as {', '.join(ggufs)}" if ggufs else ""
            raise RequestError(f"{path} is a folder; give the path of a .gguf file in it{hint}")
        if not path.is_file():
            raise RequestError(f"model file not found: {path} (give the path of a .gguf file)")
        return str(path)
    from ..demo import demo_model_path

    return str(demo_model_path())


def device_list(arg: str | None) -> list[str] | None:
    if arg is not None and not arg.strip(","+" "):
        raise RequestError(f"--devices '{arg}' names no device; use e.g. cuda:0,cuda:1 or cpu")
    if not arg:
        return None
    # a bare "cpu" or "cuda" (as the help's example writes it) means device 0 of that kind
    devices = [f"{d}:0" if d in ("cpu", "cuda") else d
               for d in (part.strip().lower() for part in arg.split(",")) if d]
    if not devices:
        raise RequestError(f"--devices '{arg}' names no device; use e.g. cuda:0,cuda:1 or cpu")
    return devices


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    overrides = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repeat_penalty,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    values: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    values["answer_format"] = json_format_arg(args)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise RequestError(f"invalid sampling option: {exc}") from exc


def json_format_arg(args: argparse.Namespace) -> JsonFormat | None:
    """--json / --json-schema FILE as the answer's format (None: free text)."""
    if args.json_schema is not None:
        path = Path(args.json_schema).expanduser()
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise RequestError(f"--json-schema: cannot read {path}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise RequestError(f"--json-schema: {path} is not JSON ({exc})") from exc
        try:
            return json_schema_format(schema, path.stem)
        except SchemaError as exc:
            raise RequestError(f"--json-schema {path}: {exc}") from exc
    return json_object_format() if args.json else None


def check_runnable(path: str) -> None:
    """Refuse, in words, a GGUF that holds no model to run (a vocabulary-only file, a projector, a
    broken or unsupported file) before a runtime is started for it: the loader's own header checks."""
    check_model_file(path)


def start_runtime(args: argparse.Namespace, *, quiet: bool = False, sample_memory_s: float = 0.0,
                  base_model_note: str | None = None, parallel: int = 1,
                  max_queue: int = 16) -> Runtime:
    """A Runtime with the model of `args` loaded; progress on stderr. `sample_memory_s` > 0 samples
    device memory into the runtime's metrics (the server's /metrics shows it). `base_model_note`:
    what to tell the user when the model is a pretrained base model (None: nothing). parallel /
    max_queue: generations batched at once and waiting (Runtime; serve's --parallel)."""
    path = model_path(args.model)
    check_runnable(path)
    devices = device_list(args.devices)
    runtime = Runtime(sample_memory_s=sample_memory_s, parallel=parallel, max_queue=max_queue)
    t0 = time.perf_counter()
    options: dict[str, Any] = {}
    if args.mmproj:
        mmproj = Path(args.mmproj).expanduser()
        if not mmproj.is_file():
            raise RequestError(f"mmproj file not found: {mmproj} (give the path of a .gguf vision projector)")
        options["mmproj"] = str(mmproj)
    if args.max_image_tokens is not None:
        if args.max_image_tokens < 1:
            raise RequestError("--max-image-tokens must be at least 1")
        options["max_image_tokens"] = args.max_image_tokens
    options["kv_type"] = args.kv_type
    if args.context is not None:
        options["context"] = args.context
    if args.experts_on is not None:
        options["experts"] = args.experts_on  # load_model reads host / auto / N / a device
    options["cpu_weights"] = args.cpu_weights
    handle = runtime.load(path, devices=devices, **options)
    tty = sys.stderr.isatty()
    try:
        for ev in handle.events():
            if ev.kind == "progress" and tty and not quiet and ev.fraction is not None:
                sys.stderr.write(f"\rloading {Path(path).name}: {ev.fraction * 100:5.1f}%")
                sys.stderr.flush()
        if tty and not quiet:
            sys.stderr.write("\r\x1b[K")
        handle.result()
    except BaseException:
        runtime.close()
        raise
    info = runtime.model_info
    assert info is not None  # the load succeeded
    if not quiet:
        print(f"loaded {Path(path).name} ({info.architecture}, on {', '.join(info.devices)}) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if info.base_model and base_model_note:
            print(f"note: {info.name} is a pretrained base model (no chat template in its file): "
                  f"{base_model_note}", file=sys.stderr)
    return runtime


# What `run` and `chat` say about a base model, by --chat-template mode (None: nothing to say).
BASE_MODEL_NOTES = {
    "auto": "it continues text, so your message is sent as plain text for it to continue "
            "(--chat-template on wraps it in a chat turn instead)",
    "on": "it was not trained on chat turns and may not follow them (--chat-template auto sends "
          "plain text for it to continue)",
    "off": None,
}


def image_part(path_text: str) -> dict[str, Any]:
    """An OpenAI image_url content part (data: URL) for a picture file, checked with Pillow."""
    path = Path(path_text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read the image {path}: {exc.strerror or exc}") from exc
    if len(data) > IMAGE_MAX_BYTES:
        raise ImageError(f"{path} is {len(data) / 2**20:.0f} MiB; pictures up to "
                         f"{IMAGE_MAX_BYTES // 2**20} MiB are accepted")
    from ..vision.preprocess import open_image

    try:  # the engine's own decoder and checks (format, size limit, truncation), with its messages
        fmt = (open_image(path).format or "").lower()
    except ImageError as exc:
        raise ImageError(f"not a picture minecart can use: {exc}") from exc
    mime = f"image/{fmt}" if fmt else (mimetypes.guess_type(path.name)[0] or "image/png")
    url = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


class StreamPrinter:
    """Writes token events: the answer to stdout, thinking dimmed on a terminal or to stderr."""

    def __init__(self, hide_thinking: bool = False) -> None:
        self.hide_thinking = hide_thinking
        self.tty = sys.stdout.isatty()
        self._dim_open = False
        self._thought = False
        self.answer: list[str] = []

    def feed(self, ev: RuntimeEvent) -> None:
        if ev.thinking and not self.hide_thinking:
            if self.tty:
                if not self._dim_open:
                    sys.stdout.write(DIM)
                    self._dim_open = True
                sys.stdout.write(ev.thinking)
                sys.stdout.flush()
            else:
                sys.stderr.write(ev.thinking)
                sys.stderr.flush()
            self._thought = True
        if ev.text:
            if self._dim_open:
                sys.stdout.write(RESET)
                self._dim_open = False
            if self._thought and not self.answer:
                (sys.stdout if self.tty else sys.stderr).write("\n")
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            self.answer.append(ev.text)

    def close(self) -> None:
        if self._dim_open:
            sys.stdout.write(RESET)
            self._dim_open = False
        if self._thought and not self.answer and not self.tty:
            sys.stderr.write("\n")
        sys.stdout.write("\n")
        sys.stdout.flush()

    @property
    def text(self) -> str:
        return "".join(self.answer)


def stats_line(final: RuntimeEvent) -> str:
    u = final.usage
    if u is None:
        return f"[{final.kind}]"
    timing = (final.data or {}).get("timing")
    prompt_tps = u.prompt_tokens_per_s or (timing.prefill_tokens_per_s if timing else None)
    decode_tps = u.decode_tokens_per_s or (timing.decode_tokens_per_s if timing else None)

    def rate(x: float | None) -> str:
        return f"{x:.1f} tok/s" if x else "n/a"

    cached = f" ({u.cached_tokens} cached)" if u.cached_tokens else ""
    if u.image_tokens:
        cached += f" ({u.image_tokens} image)"
    reason = final.finish_reason or final.kind
    return (f"prompt: {u.prompt_tokens} tokens{cached}, {rate(prompt_tps)} | generation: "
            f"{u.completion_tokens} tokens, {rate(decode_tps)} | {reason}")


def stream_reply(handle: RequestHandle, printer: StreamPrinter) -> RuntimeEvent:
    """Print a generation as it streams; Ctrl+C cancels it. Returns the terminal event."""
    try:
        for ev in handle.events():
            if ev.kind == "token":
                printer.feed(ev)
    except KeyboardInterrupt:
        handle.cancel()
        final = handle.wait(30)
        printer.close()
        return final
    printer.close()
    assert handle.final is not None  # events() ends with the terminal event
    return handle.final


# ---------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.prompt_text is not None:
        raise RequestError(f"two prompts: {args.prompt_text!r} after the model and {args.prompt!r} with -p; "
                           "give one")
    prompt = args.prompt if args.prompt is not None else args.prompt_text
    if (prompt is None and args.model is not None and not args.model.lower().endswith(".gguf")
            and not Path(args.model).exists()):
        # `minecart run "a question"`: the one word given is MODEL, and it names no file
        raise RequestError(f"no model file {args.model!r}; to ask the default model, give the prompt with -p: "
                           f"minecart run -p {shlex.quote(args.model)}")
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():  # None: started with stdin closed
            raise RequestError("give a prompt after the model or with -p/--prompt (or pipe it on stdin)")
        prompt = sys.stdin.read().strip()
    if not prompt:
        raise RequestError("the prompt is empty")
    params = sampling_params(args)
    images = [image_part(p) for p in args.image]  # check the files before loading the model
    if args.raw and (images or args.system):
        raise RequestError("--raw sends plain text: it cannot carry --system or --image")
    if args.raw and args.chat_template == "on":
        raise RequestError("--raw sends plain text; it cannot go with --chat-template on")
    note = None if args.raw else BASE_MODEL_NOTES[args.chat_template]
    runtime = start_runtime(args, base_model_note=note)
    try:
        if args.raw:
            handle = runtime.complete(prompt, params)
        else:
            messages = []
            if args.system:
                messages.append({"role": "system", "content": args.system})
            content = [{"type": "text", "text": prompt}, *images] if images else prompt
            messages.append({"role": "user", "content": content})
            handle = runtime.chat(messages, params, enable_thinking=not args.no_think,
                                  chat_template=args.chat_template)
        final = stream_reply(handle, StreamPrinter(hide_thinking=args.hide_thinking))
        if final.kind == "error":
            print(f"minecart: error: {final.text}", file=sys.stderr)
            return 1
        print(stats_line(final), file=sys.stderr)
        return 130 if final.kind == "cancelled" else 0
    finally:
        runtime.close()
