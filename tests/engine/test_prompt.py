"""engine/prompt.py: one renderer for every caller: chat template, plain text of messages, ids."""

from __future__ import annotations

import pytest
from minecart.engine.errors import RequestError
from minecart.engine.prompt import messages_text, render_prompt

from tests.engine.fake_chat_model import FakeModel


def test_plain_text_of_a_conversation_reads_as_one_document():
    messages = [{"role": "system", "content": "Facts."},
                {"role": "user", "content": "The capital of France is"},
                {"role": "assistant", "content": " Paris."},
                {"role": "user", "content": [{"type": "text", "text": "The capital of Italy is"}]}]
    # a reply continues the text it was generated after; a new message is a new paragraph
    assert messages_text(messages) == "Facts.\n\nThe capital of France is Paris.\n\nThe capital of Italy is"
    with pytest.raises(RequestError, match="cannot carry pictures"):
        messages_text([{"role": "user", "content": [{"type": "image", "path": "a.png"}]}])


def test_modes_and_the_turn_boundary():
    model = FakeModel()  # byte tokenizer: one id per byte
    msgs = [{"role": "user", "content": "hi"}]
    on = render_prompt(model, msgs, enable_thinking=True, mode="on", find_turn_boundary=True)
    assert model.tokenizer.decode(on.ids) == "<|user|>hi\n<|assistant|><think>\n"
    assert on.opens_thinking and on.turn_boundary == len("<|user|>hi\n") and on.source == "chat"
    off = render_prompt(model, msgs, mode="off")
    assert model.tokenizer.decode(off.ids) == "hi" and off.source == "text" and not off.opens_thinking
    assert render_prompt(model, msgs, mode="auto").source == "chat"
    model.is_base_model = True
    assert render_prompt(model, msgs, mode="auto").source == "text"
    with pytest.raises(RequestError, match="tools need the chat template"):
        render_prompt(model, msgs, mode="auto", tools=[{"function": {"name": "f"}}])
    assert render_prompt(model, [5, 6]).ids == [5, 6]
    assert render_prompt(model, "ab").ids == [97, 98]
