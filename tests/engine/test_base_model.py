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
