"""Model.is_base_model: pretrained files (no chat template) are told apart from chat-tuned ones."""

from minecart.engine import load_model


def test_fixture_with_template_is_not_base(fixtures_dir):
    model = load_model(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf", devices=["cpu:0"])
    try:
        assert model.gguf.get("tokenizer.chat_template")
        assert model.is_base_model is False
    finally:
        model.close()


def test_demo_model_is_base():
    from minecart.engine.demo import demo_model_path

    model = load_model(demo_model_path(), devices=["cpu:0"])
    try:
        assert model.gguf.get("tokenizer.chat_template") is None
        assert model.is_base_model is True
    finally:
        model.close()


def test_cli_run_continues_a_base_models_text(tmp_path):
    """The README's example: the demo base model gets the prompt as plain text (no chat turn), says
    so in one line, and answers the question greedily with Berlin."""
    import os
    import subprocess
    import sys

    from minecart.engine.demo import demo_model_path

    demo_model_path()  # assembled once, before the subprocess needs it
    prompt = "Question: What is the capital of Germany?\nAnswer:"
    r = subprocess.run([sys.executable, "-m", "minecart.engine.cli", "run", "-p", prompt, "--temp", "0",
                        "--max-tokens", "7", "--devices", "cpu"],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, NO_COLOR="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == " The capital of Germany is Berlin.\n"
    assert "pretrained base model" in r.stderr and "--chat-template on" in r.stderr
    assert "prompt: 13 tokens" in r.stderr  # the text alone, no turn markers
