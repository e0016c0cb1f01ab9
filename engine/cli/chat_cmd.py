"""`minecart chat`: an interactive chat in the terminal that keeps the model's session between turns.

Each turn sends the whole conversation with the same conversation id, so the runtime reuses the
session's cached prefix and only the new message is computed. Commands: /reset (forget the
conversation), /think on|off, /help, /exit (or end of input). Ctrl+C stops an answer; at the prompt it
quits. Lines read from a pipe work too: then each message is echoed as "> message" before its answer
and a blank line ends each turn, so the output reads as a transcript. A pretrained base model gets the
conversation as plain text to continue (--chat-template, engine/prompt.py).

This module does not load or run the model itself; it is a client of the Runtime like the app.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import RequestError
from .run_cmd import (
    BASE_MODEL_NOTES,
    StreamPrinter,
    add_model_args,
    add_sampling_args,
    sampling_params,
    start_runtime,
    stats_line,
    stream_reply,
)

HELP = """commands:
  /reset          forget the conversation (start over)
  /think on|off   turn thinking on or off for the next answers
  /help           this text
  /exit           quit (also /quit, Ctrl+D)"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat", help="chat with a model in the terminal",
        description="Interactive chat that keeps the model session between turns. " + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(func=chat)


def _read_line(tty: bool) -> str | None:
    try:
        if tty:
            return input("> ")
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    except EOFError:
        return None


def chat(args: argparse.Namespace) -> int:
    if sys.stdin is None:  # started with stdin closed: there is nobody to chat with
        raise RequestError("minecart chat reads messages from stdin, which is closed; use "
                           "minecart run -p PROMPT for a single answer")
    params = sampling_params(args)
    runtime = start_runtime(args, base_model_note=BASE_MODEL_NOTES[args.chat_template])
    tty = sys.stdin.isatty()
    transcript = not tty  # piped input: echo each message so the turns stay apart
    thinking = not args.no_think
    turn_id = 0
    messages: list[dict[str, Any]] = []

    def restart() -> None:
        nonlocal messages
        messages = [{"role": "system", "content": args.system}] if args.system else []

    restart()
    if tty:
        print("type a message; /help for commands", file=sys.stderr)
    try:
        while True:
            try:
                line = _read_line(tty)
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if line is None:
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd, _, arg = text.partition(" ")
                cmd, arg = cmd.lower(), arg.strip().lower()
                if cmd in ("/exit", "/quit", "/bye"):
                    break
                if cmd == "/reset":
                    runtime.forget(f"cli-{turn_id}").wait()
                    turn_id += 1
                    restart()
                    print("[conversation reset]", file=sys.stderr)
                    continue
                if cmd == "/think" and arg in ("on", "off"):
                    thinking = arg == "on"
                    print(f"[thinking {'on' if thinking else 'off'}]", file=sys.stderr)
                    continue
                if cmd in ("/help", "/?"):
                    print(HELP, file=sys.stderr)
                    continue
                if cmd == "/think":
                    print("usage: /think on|off", file=sys.stderr)
                    continue
                # anything else that starts with "/" is an ordinary message
            messages.append({"role": "user", "content": text})
            if transcript:
                print(f"> {text}", flush=True)
            handle = runtime.chat(messages, params, enable_thinking=thinking,
                                  conversation_id=f"cli-{turn_id}", chat_template=args.chat_template)
            printer = StreamPrinter(hide_thinking=args.hide_thinking)
            final = stream_reply(handle, printer)
            if transcript:
                print(flush=True)  # a blank line ends the turn
            if final.kind == "error":
                print(f"minecart: error: {final.text}", file=sys.stderr)
                messages.pop()  # the failed question is not part of the conversation
                continue
            # The answer (cancelled ones too, as far as they got) becomes history; thinking does not:
            # the chat templates drop earlier turns' thinking anyway.
            messages.append({"role": "assistant", "content": printer.text})
            print(stats_line(final), file=sys.stderr)
    finally:
        runtime.close()
    return 0
