"""`minecart run` / `chat` / `serve`: flags, and end to end on the fixture GGUF through a subprocess.

The fixture model has random weights, so its text is gibberish; what the tests check is that the CLI
feeds the engine the right prompt and prints what the engine produced: greedy output of the "short"
reference sequence is known (" Sunt" repeated, large logit margins), and the chat keeps its session
between turns (the second turn reports cached prompt tokens, the turn after /reset none).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from minecart.engine.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 240


def minecart(*args, stdin: str | None = None, timeout: float = TIMEOUT):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "minecart.engine.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
    )


@pytest.fixture(scope="module")
def tiny_model(fixtures_dir):
    return str(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf")


def has_chat_template() -> bool:
    try:
        import minecart.engine.chat_template  # noqa: F401
    except ImportError:
        return False
    return True


needs_template = pytest.mark.skipif(not has_chat_template(), reason="engine/chat_template.py not built yet")


def test_every_flag_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("run", "chat", "serve"):
        assert name in sub.choices, f"`minecart {name}` is not registered"
        for action in sub.choices[name]._actions:
            assert action.help, f"minecart {name}: {action.option_strings or action.dest} has no help"
    args = parser.parse_args(["run", "m.gguf", "-p", "hi", "--no-think", "--temp", "0", "--max-tokens",
                              "7", "--seed", "3", "--devices", "cuda:0,cuda:1", "--image", "a.png",
                              "--image", "b.png", "--system", "S"])
    assert (args.model, args.prompt, args.no_think, args.temperature, args.max_tokens, args.seed) == (
        "m.gguf", "hi", True, 0.0, 7, 3)
    assert args.devices == "cuda:0,cuda:1" and args.image == ["a.png", "b.png"] and args.system == "S"
    args = parser.parse_args(["serve", "--port", "9000"])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 9000


def test_run_streams_the_greedy_answer_and_speeds(tiny_model):
    r = minecart("run", tiny_model, "-p", "The quick brown fox jumps over the lazy dog.", "--raw",
                 "--temp", "0", "--max-tokens", "6", "--devices", "cpu")
    assert r.returncode == 0, r.stderr
    # greedy continuation of the "short" reference sequence (transformers and llama.cpp agree)
    assert r.stdout == " Sunt" * 6 + "\n"
    m = re.search(r"prompt: (\d+) tokens.*, ([\d.]+) tok/s \| generation: (\d+) tokens, ([\d.]+) tok/s",
                  r.stderr)
    assert m, r.stderr
    assert int(m.group(1)) == 10 and int(m.group(3)) == 6
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0
    assert "Traceback" not in r.stderr


def test_run_takes_the_prompt_after_the_model(tiny_model):
    """`minecart run MODEL "prompt"` is `-p "prompt"`; both at once is refused, not one of them dropped."""
    r = minecart("run", tiny_model, "The quick brown fox jumps over the lazy dog.", "--raw", "--temp", "0",
                 "--max-tokens", "6", "--devices", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == " Sunt" * 6 + "\n"
    r = minecart("run", tiny_model, "one", "-p", "two", "--devices", "cpu")
    assert r.returncode == 1 and "two prompts" in r.stderr and "Traceback" not in r.stderr
    # a question alone is taken for MODEL: the error says how to ask the default model
    r = minecart("run", "Why is the sky blue?", "--devices", "cpu")
    assert r.returncode == 1 and "minecart run -p 'Why is the sky blue?'" in r.stderr, r.stderr


@needs_template
def test_run_with_chat_template_and_no_think(tiny_model):
    r = minecart("run", tiny_model, "-p", "What is the capital of France?", "--system",
                 "You are a helpful assistant.", "--no-think", "--temp", "0", "--max-tokens", "5",
                 "--devices", "cpu")
    assert r.returncode == 0, r.stderr
    m = re.search(r"prompt: (\d+) tokens.*\| generation: (\d+) tokens", r.stderr)
    assert m, r.stderr
    # <|im_start|>system ... <|im_start|>assistant\n<think>\n\n</think>\n\n, tokenized with the
    # special tokens recognised: a handful of tokens, not the ~100 that the literal text would give
    assert 20 <= int(m.group(1)) <= 40
    assert 1 <= int(m.group(2)) <= 5


def test_cli_errors_are_one_line_messages(tmp_path):
    r = minecart("run", str(tmp_path / "nope.gguf"), "-p", "x", timeout=120)
    assert r.returncode == 1
    assert "model file not found" in r.stderr and "Traceback" not in r.stderr
    r = minecart("run", str(tmp_path / "nope.gguf"), "-p", "x", "--temp", "-1", timeout=120)
    assert r.returncode == 1 and "temperature" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "pic.png"
    bad.write_bytes(b"not a picture")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    r = minecart("run", str(model), "-p", "x", "--image", str(bad), timeout=120)
    assert r.returncode == 1 and "not a picture" in r.stderr and "Traceback" not in r.stderr


@needs_template
def test_chat_keeps_the_session_between_turns(tiny_model):
    stdin = "\n".join([
        "What is the capital of France?",
        "/think off",
        "And of Korea?",
        "/reset",
        "Hello again",
        "/exit",
        "this line is never read",
    ]) + "\n"
    r = minecart("chat", tiny_model, "--temp", "0", "--max-tokens", "4", "--devices", "cpu",
                 stdin=stdin)
    assert r.returncode == 0, r.stderr
    assert "[thinking off]" in r.stderr and "[conversation reset]" in r.stderr
    stats = re.findall(r"prompt: (\d+) tokens(?: \((\d+) cached\))?.*\| generation: (\d+) tokens",
                       r.stderr)
    assert len(stats) == 3, r.stderr
    (p1, c1, g1), (p2, c2, g2), (p3, c3, g3) = stats
    assert not c1  # first turn: nothing cached
    # second turn: the first turn's prompt up to its generation prompt comes from the session
    # (the template re-renders the first answer without its <think> block, so the tokens differ
    # from there on)
    assert c2 and int(p1) - 8 <= int(c2) < int(p1) and int(p2) > int(p1)
    assert not c3 and int(p3) < int(p2)  # after /reset: a fresh session, a short prompt
    assert all(1 <= int(g) <= 4 for g in (g1, g2, g3))
    # piped: a transcript, each message echoed before its answer and a blank line after each turn
    assert re.findall(r"^> (.*)$", r.stdout, re.M) == ["What is the capital of France?", "And of Korea?",
                                                       "Hello again"]
    assert r.stdout.startswith("> What is the capital of France?\n") and r.stdout.endswith("\n\n")
    assert r.stdout.count("\n\n> ") == 2, r.stdout


def test_no_model_means_the_demo_model(monkeypatch, tmp_path):
    from minecart.engine import demo
    from minecart.engine.cli import run_cmd
    from minecart.engine.errors import RequestError

    fake = tmp_path / "gemma-3-270m.gguf"
    monkeypatch.setattr(demo, "demo_model_path", lambda: fake)
    assert run_cmd.model_path(None) == str(fake)
    with pytest.raises(RequestError, match="model file not found"):
        run_cmd.model_path(str(tmp_path / "missing.gguf"))
    assert run_cmd.device_list(" cuda:0, cuda:1 ,") == ["cuda:0", "cuda:1"]
    assert run_cmd.device_list(None) is None


def test_image_part_is_a_checked_data_url(tmp_path):
    from minecart.engine.cli.run_cmd import image_part
    from PIL import Image

    pic = tmp_path / "dot.png"
    Image.new("RGB", (3, 2), (200, 10, 10)).save(pic)
    part = image_part(str(pic))
    assert part["type"] == "image_url"
    assert part["image_url"]["url"].startswith("data:image/png;base64,iVBORw0KGgo")


def test_a_bad_flag_shows_the_subcommands_usage():
    r = minecart("run", "--bogus", timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: minecart run") and "unrecognized arguments: --bogus" in r.stderr
    r = minecart("chat", "m.gguf", "--raw", timeout=120)  # --raw is run's alone
    assert r.returncode == 2 and r.stderr.startswith("usage: minecart chat")


def test_every_flag_a_message_suggests_exists():
    from minecart.engine.cli import chat_cmd, run_cmd, serve_cmd  # noqa: F401 - the notes live there

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    notes = [n for n in run_cmd.BASE_MODEL_NOTES.values() if n]
    assert notes and all("--raw" not in n for n in notes + [serve_cmd.BASE_MODEL_NOTE])
    for command in ("run", "chat"):
        for note in notes:
            for flag, value in re.findall(r"(--[a-z-]+)(?: (\w+))?", note):
                args = sub.choices[command].parse_args(["m.gguf", flag, value] if value else ["m.gguf", flag])
                assert args.chat_template == value
    assert '"chat_template_mode": "on"' in serve_cmd.BASE_MODEL_NOTE


def test_vocabulary_only_file_is_named_for_what_it_is(fixtures_dir):
    r = minecart("run", str(fixtures_dir / "qwen35-vocab.gguf"), "-p", "hi", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "vocabulary-only GGUF" in r.stderr and "no weights" in r.stderr
    assert "re-convert" not in r.stderr


def test_cli_chooses_blas_threads_before_numpy_loads(fixtures_dir):
    from minecart.engine.threads import THREAD_ENV_VARS, default_threads, usable_cores

    script = ("import os, sys\n"
              "from minecart.engine.cli import main\n"
              "main(sys.argv[1:])\n"
              f"print(' '.join(os.environ.get(k, '-') for k in {THREAD_ENV_VARS!r}))\n")
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    vocab = str(fixtures_dir / "qwen35-vocab.gguf")  # refused after parsing: quick
    for extra, expected in (([], default_threads(usable_cores())), (["--threads", "3"], 3)):
        r = subprocess.run([sys.executable, "-c", script, "run", vocab, "-p", "x", *extra],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert r.stdout.split() == [str(expected)] * len(THREAD_ENV_VARS), r.stderr
    r = subprocess.run([sys.executable, "-c", script, "run", vocab, "-p", "x"], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env={**env, "OPENBLAS_NUM_THREADS": "2"})
    assert r.stdout.split()[0] == "2" and set(r.stdout.split()[1:]) == {"-"}  # the user's setting wins


def test_run_answers_in_a_json_schema(tiny_model, tmp_path):
    import json

    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False}
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(schema))
    r = minecart("run", tiny_model, "-p", "An animal as JSON", "--no-think", "--temp", "0", "--max-tokens", "200",
                 "--json-schema", str(path), "--devices", "cpu")
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert set(answer) == {"kind", "ok"} and answer["kind"] in ("cat", "dog") and isinstance(answer["ok"], bool)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "string", "pattern": "x"}))
    r = minecart("run", tiny_model, "-p", "x", "--json-schema", str(bad), "--devices", "cpu", timeout=120)
    assert r.returncode == 1 and "'pattern' is not supported" in r.stderr and "Traceback" not in r.stderr
