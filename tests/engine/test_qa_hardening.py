"""QA round: bad input a demanding user gives the engine and CLI, each once a bug, now a clear error.

Each test here failed before its fix: NaN/negative sampling options slipped through to a NumPy error
after the model had loaded, `--devices cpu` (the help's own example) was refused, an mmproj passed as the
model said only "architecture 'clip' is not supported", prompts past the context length ran on into
garbage, lone surrogates (JSON "\\udc80", undecodable argv bytes) crashed the tokenizer with a TypeError,
a closed stdin or an unexpected exception printed a traceback. Real engine on the fixture GGUF.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
from minecart.engine.cli import main as cli_main
from minecart.engine.cli.run_cmd import device_list
from minecart.engine.errors import RequestError, UnsupportedArchitectureError
from minecart.engine.sampling import SamplingParams, greedy_params

TIMEOUT = 120


@pytest.fixture(scope="module")
def dense_path(fixtures_dir):
    return fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"


@pytest.fixture(scope="module")
def dense_model(dense_path):
    from minecart.engine import load_model

    model = load_model(dense_path, devices=["cpu:0"])
    yield model
    model.close()


# -- sampling options -------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("repetition_penalty", math.nan),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
])
def test_non_finite_sampling_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_negative_seed_is_refused_and_zero_is_fine():
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        SamplingParams(seed=-1)
    assert SamplingParams(seed=0).seed == 0


def test_cli_bad_seed_fails_before_loading(dense_path, capsys):
    rc = cli_main(["run", str(dense_path), "-p", "hi", "--seed", "-1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "seed must be an integer >= 0" in err
    assert "loaded" not in err and "Traceback" not in err


# -- devices and files ------------------------------------------------------------------------------


def test_bare_device_kinds_mean_device_zero():
    assert device_list("cpu") == ["cpu:0"]
    assert device_list(" CPU , cuda ") == ["cpu:0", "cuda:0"]
    assert device_list("cuda:1,cpu:0") == ["cuda:1", "cpu:0"]
    assert device_list(None) is None
    for empty in ("", ",", " , "):
        with pytest.raises(RequestError, match="names no device"):
            device_list(empty)


def test_mmproj_given_as_the_model_says_what_it_is(fixtures_dir):
    from minecart.engine import load_model

    with pytest.raises(UnsupportedArchitectureError, match="vision projector.*--mmproj"):
        load_model(fixtures_dir / "vision" / "mmproj-qwen35-tiny-vl-f16.gguf", devices=["cpu:0"])


# -- context length ---------------------------------------------------------------------------------


def _with_context(model, n):
    model.config = dataclasses.replace(model.config, context_length=n)


def test_prompt_beyond_the_context_is_a_request_error(dense_model):
    from minecart.engine.generation import generate

    saved = dense_model.config
    try:
        _with_context(dense_model, 40)
        with pytest.raises(RequestError, match="context length"):
            list(generate(dense_model, list(range(100, 150)), greedy_params(max_tokens=4)))
        # room for part of the answer: it stops with "length" when the context is full
        events = list(generate(dense_model, list(range(100, 130)), greedy_params(max_tokens=100)))
        assert events[-1].finish_reason == "length"
        assert events[-1].generated_tokens == 10
    finally:
        dense_model.config = saved
    events = list(generate(dense_model, list(range(100, 130)), greedy_params(max_tokens=12)))
    assert events[-1].generated_tokens == 12  # unchanged with the real context length


def _fresh_runtime(path):
    """A Runtime on its own copy of the fixture model (closing a runtime frees its model)."""
    from minecart.engine import load_model
    from minecart.engine.runtime import Runtime

    made = []

    def loader(*_a, **_k):
        made.append(load_model(path, devices=["cpu:0"]))
        return made[-1]

    rt = Runtime(loader=loader, sample_memory_s=0)
    rt.load(str(path)).result(TIMEOUT)
    return rt, made[-1]


def test_runtime_turns_an_overlong_prompt_into_an_error_event_and_keeps_going(dense_path):
    rt, model = _fresh_runtime(dense_path)
    saved = model.config
    try:
        _with_context(model, 16)
        final = rt.chat([{"role": "user", "content": "word " * 40}], greedy_params(max_tokens=4),
                        conversation_id="c").wait(TIMEOUT)
        assert final.kind == "error"
        assert "context length" in final.text and "start a new chat" in final.text
        model.config = saved
        final = rt.chat([{"role": "user", "content": "hi"}], greedy_params(max_tokens=3),
                        conversation_id="c").wait(TIMEOUT)
        assert final.kind == "done", final.text
    finally:
        rt.close()


# -- text that is not valid Unicode -----------------------------------------------------------------


def test_lone_surrogates_reach_the_model_as_replacement_characters(dense_path):
    from minecart.engine.runtime import valid_unicode

    assert valid_unicode("caf\udce9 ok") == "caf\ufffd ok"
    assert valid_unicode("plain") == "plain"
    rt, _ = _fresh_runtime(dense_path)
    try:
        message = {"role": "user", "content": "a\x00b\udc80"}
        final = rt.chat([message], greedy_params(max_tokens=2)).wait(TIMEOUT)
        assert final.kind == "done", final.text
        assert message["content"] == "a\x00b\udc80"  # the caller's message is not modified
        parts = [{"role": "user", "content": [{"type": "text", "text": "x\udcff"}]}]
        assert rt.chat(parts, greedy_params(max_tokens=2)).wait(TIMEOUT).kind == "done"
        final = rt.complete("\udcffHello", greedy_params(max_tokens=2)).wait(TIMEOUT)
        assert final.kind == "done", final.text
    finally:
        rt.close()


# -- the command line never shows a traceback -------------------------------------------------------


def test_run_and_chat_with_stdin_closed(monkeypatch, dense_path, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    assert cli_main(["run", str(dense_path)]) == 1
    assert "give a prompt after the model or with -p" in capsys.readouterr().err
    assert cli_main(["chat", str(dense_path)]) == 1
    err = capsys.readouterr().err
    assert "stdin, which is closed" in err and "Traceback" not in err


def test_an_unexpected_exception_is_one_line_not_a_traceback(monkeypatch, dense_path, capsys):
    from minecart.engine.cli import inspect_cmd

    def broken(*_a, **_k):
        raise ZeroDivisionError("boom")

    monkeypatch.delenv("MINECART_DEBUG", raising=False)
    monkeypatch.setattr(inspect_cmd, "describe_model", broken)
    rc = cli_main(["inspect", str(dense_path)])
    err = capsys.readouterr().err
    assert rc == 70, err
    assert "internal error: ZeroDivisionError: boom" in err and "report it" in err


def test_ctrl_c_while_the_cli_starts_is_a_clean_exit(monkeypatch, capsys):
    import minecart.engine.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["run"]) == 130
    assert "interrupted" in capsys.readouterr().err


# -- a broken file does not cost the model that works -----------------------------------------------


def test_loading_a_broken_file_keeps_the_loaded_model(dense_path, fixtures_dir, tmp_path):
    from minecart.engine.runtime import Runtime

    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model\n")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(dense_path.read_bytes()[:-5000])
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(dense_path, devices=["cpu:0"]).result(TIMEOUT)
        before = rt.chat([{"role": "user", "content": "hi"}], greedy_params(max_tokens=4)).wait(TIMEOUT)
        assert before.kind == "done", before.text
        for bad, words in ((text, "not a GGUF file"), (truncated, "runs past the end"),
                           (fixtures_dir / "vision" / "mmproj-qwen35-tiny-vl-f16.gguf", "--mmproj"),
                           (tmp_path, "not a regular file")):
            final = rt.load(bad, devices=["cpu:0"]).wait(TIMEOUT)
            assert final.kind == "error" and words in final.text, (bad, final.text)
            assert rt.loaded and rt.model_info.path.endswith(dense_path.name)
        after = rt.chat([{"role": "user", "content": "hi"}], greedy_params(max_tokens=4)).wait(TIMEOUT)
        assert after.kind == "done", after.text
        assert after.usage.completion_tokens == before.usage.completion_tokens == 4
    finally:
        rt.close()


def test_synth_refuses_a_negative_seed_and_keeps_a_log_free_of_redraws(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert cli_main(["synth", "--shape", "tiny-dense", "--seed", "-5", str(out)]) == 1
    assert "--seed must be an integer >= 0" in capsys.readouterr().err and not out.exists()
    assert cli_main(["synth", "--shape", "tiny-dense", "--layers", "1", str(out)]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "wrote" in captured.out  # stderr is not a terminal here


def test_cli_image_errors_name_the_problem_not_pillow_internals(fixtures_dir, tmp_path):
    from minecart.engine.cli.run_cmd import image_part
    from minecart.engine.errors import ImageError

    garbage = tmp_path / "holiday.png"
    garbage.write_bytes(b"not a png at all" * 4)
    with pytest.raises(ImageError, match="not an image format minecart can read") as err:
        image_part(str(garbage))
    assert "BytesIO" not in str(err.value) and "holiday.png" in str(err.value)
    good = fixtures_dir / "vision" / "images" / "photo_320x180.png"
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ImageError, match="damaged or truncated"):
        image_part(str(truncated))
    part = image_part(str(good))
    assert part["image_url"]["url"].startswith("data:image/png;base64,")


def test_a_data_url_with_broken_base64_says_so(fixtures_dir):
    import base64

    from minecart.engine.errors import ImageError
    from minecart.engine.vision.preprocess import open_image

    for payload in ("!!!!", "iVBORw0KGgo!!!!AAAA", "abc"):
        with pytest.raises(ImageError, match="base64 payload is invalid"):
            open_image("data:image/png;base64," + payload)
    png = (fixtures_dir / "vision" / "images" / "tiny_40x30.png").read_bytes()
    wrapped = base64.encodebytes(png).decode()  # MIME style: a newline every 76 characters
    assert open_image("data:image/png;base64," + wrapped).size == (40, 30)


def test_raw_completion_on_a_base_model_does_not_advise_raw(capsys):
    from minecart.engine.demo import demo_model_installed

    if not demo_model_installed():
        pytest.skip("demo model not installed")
    rc = cli_main(["run", "--raw", "-p", "The capital of France is", "--max-tokens", "2", "--temp", "0"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "loaded" in err and "try --raw" not in err


# -- the HTTP API on the real engine ----------------------------------------------------------------


def test_http_overlong_prompt_is_a_400_and_a_lone_surrogate_is_served(dense_path):
    import httpx
    from minecart.engine.server import ServerThread, create_app

    rt, model = _fresh_runtime(dense_path)
    server = ServerThread(create_app(rt)).start()
    try:
        url = server.url + "/v1/chat/completions"
        _with_context(model, 24)
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 4},
                       timeout=TIMEOUT)
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 4,
                                  "stream": True}, timeout=TIMEOUT)
        assert '"error"' in r.text and "context length" in r.text  # an SSE error event, then the end
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
                                  "temperature": 0}, timeout=TIMEOUT)
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 24  # context full
        # a lone surrogate is valid JSON; it used to be a 500 "TextInputSequence must be str"
        raw = b'{"messages":[{"role":"user","content":"a\\u0000b\\udc80"}],"max_tokens":2}'
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                       content=b'{"prompt":"\\udcffHello","max_tokens":2}',
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
        rt.close()


def test_a_folder_given_as_the_model_is_called_a_folder(tmp_path, capsys):
    (tmp_path / "model-q8.gguf").write_bytes(b"")
    assert cli_main(["run", str(tmp_path), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert "is a folder" in err and "model-q8.gguf" in err and "not found" not in err


# -- multi-turn consistency through the runtime ----------------------------------------------------


def test_regenerate_edit_and_branch_switch_match_a_fresh_session(dense_path):
    """Greedy replies on a reused conversation (prefix cache, GDN snapshots, rewinds) equal the same
    prompt computed from scratch, for regenerate, an edited last or first message, and going back."""
    rt, _ = _fresh_runtime(dense_path)

    def ask(messages, conversation=None):
        handle = rt.chat(messages, greedy_params(max_tokens=6), conversation_id=conversation,
                         enable_thinking=False)
        events = list(handle.events(TIMEOUT))
        assert events[-1].kind == "done", events[-1].text
        return [e.generation.token for e in events if e.kind == "token"], events[-1].usage

    try:
        first = [{"role": "user", "content": "Tell me about GPUs and mining cards."}]
        tokens, _ = ask(first, "c")
        assert tokens == ask(first)[0]
        second = first + [{"role": "assistant", "content": "They are cheap."},
                          {"role": "user", "content": "And the P104-100?"}]
        tokens2, usage = ask(second, "c")
        assert usage.cached_tokens > 0 and tokens2 == ask(second)[0]
        again, usage = ask(second, "c")  # regenerate: the whole prompt is cached
        assert again == tokens2 and usage.cached_tokens == usage.prompt_tokens
        edited = second[:-1] + [{"role": "user", "content": "And the CMP 100-210?"}]
        assert ask(edited, "c")[0] == ask(edited)[0]
        other = [{"role": "user", "content": "Tell me about CPUs."}]
        assert ask(other, "c")[0] == ask(other)[0]
        assert ask(second, "c")[0] == tokens2  # back to the first branch
    finally:
        rt.close()


def test_regenerate_with_a_picture_reuses_the_whole_prompt(fixtures_dir):
    from minecart.engine.runtime import Runtime

    vision = fixtures_dir / "vision"
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(vision / "qwen35-tiny-vl-f16.gguf", devices=["cpu:0"]).result(TIMEOUT)
        picture = {"type": "image", "path": str(vision / "images" / "tiny_40x30.png")}
        messages = [{"role": "user", "content": [picture, {"type": "text", "text": "what is it?"}]}]

        def ask():
            events = list(rt.chat(messages, greedy_params(max_tokens=4), conversation_id="v",
                                  enable_thinking=False).events(TIMEOUT))
            assert events[-1].kind == "done", events[-1].text
            return [e.generation.token for e in events if e.kind == "token"], events[-1].usage

        tokens, usage = ask()
        assert usage.image_tokens > 0
        again, usage = ask()
        assert again == tokens and usage.cached_tokens == usage.prompt_tokens
    finally:
        rt.close()


def test_serve_refuses_a_busy_port_before_loading():
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "minecart.engine.cli", "serve", "/nonexistent.gguf",
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
