"""Chat template tests: the Qwen3.5 template embedded in the fixtures' vocab GGUF must reproduce the
fixtures' rendered chat text exactly; the built-in fallbacks, the sandbox and `split_thinking`."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from minecart.engine.chat_template import (
    ChatTemplate,
    builtin_template_source,
    normalize_messages,
    prompt_opens_thinking,
    split_thinking,
)
from minecart.engine.errors import TemplateError
from minecart.engine.gguf_file import GGUFFile

VISION = "<|vision_start|><|image_pad|><|vision_end|>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt <city> & Umgebung",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

# conversations on which the built-in Qwen3.5 fallback must render exactly like the real template
CONVERSATIONS = [
    dict(messages=[{"role": "user", "content": "hi"}]),
    dict(messages=[{"role": "user", "content": "hi"}], enable_thinking=False),
    dict(
        messages=[
            {"role": "system", "content": "Be brief. ü"},
            {"role": "user", "content": "Weather in Seoul?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments":
                    '{"city": "Seoul", "days": 3, "opts": {"unit": "C"}, "flag": true}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Busan"}}},
            ]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": '{"temp": 23}'},
        ],
        tools=[WEATHER_TOOL],
    ),
    dict(
        messages=[
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
            {"role": "user", "content": [{"type": "text", "text": "What is this? "}, {"type": "image"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
            {"role": "assistant", "content": "A cat.", "reasoning": "looks like a cat"},
        ],
        add_generation_prompt=False,
    ),
    dict(
        messages=[
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "Calling.", "tool_calls": [
                {"function": {"name": "f", "arguments": {"x": [1, 2], "y": None}}}]},
            {"role": "tool", "content": "res"},
            {"role": "user", "content": "thanks"},
        ],
        tools=[WEATHER_TOOL],
        add_vision_id=True,
    ),
    dict(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                {"type": "text", "text": "describe both"}]}],
         add_vision_id=True),
]


@pytest.fixture(scope="module")
def qwen_gguf(fixtures_dir) -> GGUFFile:
    return GGUFFile(fixtures_dir / "qwen35-vocab.gguf")


@pytest.fixture(scope="module")
def qwen_template(qwen_gguf) -> ChatTemplate:
    return ChatTemplate.from_gguf(qwen_gguf)


@pytest.fixture(scope="module")
def sequences(fixtures_dir) -> dict:
    return json.loads((fixtures_dir / "sequences.json").read_text("utf-8"))


def fake_gguf(architecture: str, template: str | None = None) -> SimpleNamespace:
    meta = {"general.architecture": architecture, "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return SimpleNamespace(metadata=meta, path=Path(f"/models/{architecture}.gguf"))


# ------------------------------------------------------------------------------- Qwen3.5 template


def test_qwen_template_reproduces_the_fixture_chat_text(qwen_template, sequences):
    assert "tokenizer.chat_template" in qwen_template.origin
    assert qwen_template.eos_token == "<|im_end|>"
    text = qwen_template.render(sequences["chat_messages"])
    assert text == sequences["chat_text"]
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_enable_thinking_false_gives_the_empty_think_block(qwen_template, sequences):
    off = qwen_template.render(sequences["chat_messages"], enable_thinking=False)
    assert off == sequences["chat_text"] + "\n</think>\n\n"
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # None leaves the choice to the template (this 4B-style template thinks by default)
    assert qwen_template.render(sequences["chat_messages"], enable_thinking=None) == sequences["chat_text"]
    no_prompt = qwen_template.render(sequences["chat_messages"], add_generation_prompt=False)
    assert no_prompt.endswith("prints it.<|im_end|>\n")


def test_tools_and_tool_calls_render(qwen_template):
    conv = CONVERSATIONS[2]
    text = qwen_template.render(conv["messages"], tools=conv["tools"])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    # tojson as HF does it: no HTML escaping, non-ASCII kept
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text
    assert "\n\nBe brief. ü<|im_end|>\n" in text  # the user's system prompt follows the tool block
    # JSON-string arguments were parsed; mappings as JSON, scalars as strings
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSeoul\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n") in text
    assert "<parameter=flag>\nTrue\n</parameter>" in text  # Qwen3.5 writes Python scalars
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n"
            "{\"temp\": 23}\n</tool_response><|im_end|>\n") in text
    # reasoning of the turn after the last real user query is kept
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>" in text


def test_images_render_the_vision_placeholder(qwen_template):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    text = qwen_template.render(msgs)
    assert f"<|im_start|>user\n{VISION}and{VISION}<|im_end|>\n" in text
    numbered = qwen_template.render(msgs, add_vision_id=True)
    assert f"Picture 1: {VISION}andPicture 2: {VISION}" in numbered


def test_past_reasoning_is_dropped_before_the_last_query(qwen_template):
    conv = CONVERSATIONS[3]
    text = qwen_template.render(conv["messages"], add_generation_prompt=False)
    assert "r1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    # `reasoning` is accepted as an alias of reasoning_content
    assert "<|im_start|>assistant\n<think>\nlooks like a cat\n</think>\n\nA cat.<|im_end|>" in text


def test_caller_messages_are_not_modified(qwen_template):
    conv = copy.deepcopy(CONVERSATIONS[2])
    before = copy.deepcopy(conv)
    qwen_template.render(conv["messages"], tools=conv["tools"])
    assert conv == before
    assert isinstance(conv["messages"][2]["tool_calls"][0]["function"]["arguments"], str)


# ---------------------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_builtin_qwen35_fallback_renders_like_the_real_template(qwen_template, index):
    fallback = ChatTemplate.builtin("chatml_qwen35")
    conv = dict(CONVERSATIONS[index])
    messages = conv.pop("messages")
    assert fallback.render(messages, **conv) == qwen_template.render(messages, **conv)


def test_builtin_qwen35_fallback_chat_text_and_preserve_thinking(sequences):
    fallback = ChatTemplate.builtin("chatml_qwen35")
    assert fallback.render(sequences["chat_messages"]) == sequences["chat_text"]
    msgs = CONVERSATIONS[3]["messages"]
    kept = fallback.render(msgs, add_generation_prompt=False, preserve_thinking=True)  # Qwen3.6 option
    assert "<think>\nr1\n</think>\n\nA1" in kept


def test_from_gguf_falls_back_by_architecture(qwen_gguf):
    gemma = ChatTemplate.from_gguf(fake_gguf("gemma3"))
    assert "gemma3" in gemma.origin and gemma.bos_token == "<bos>" and gemma.eos_token == "<eos>"
    qwen = ChatTemplate.from_gguf(fake_gguf("qwen35moe"))
    assert "chatml_qwen35" in qwen.origin
    other = ChatTemplate.from_gguf(fake_gguf("llama"))
    assert other.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    own = ChatTemplate.from_gguf(fake_gguf("gemma3", "{{ bos_token }}[{{ messages[0].content }}]"))
    assert own.render([{"role": "user", "content": "x"}]) == "<bos>[x]"
    with pytest.raises(TemplateError, match="tool_use"):
        ChatTemplate.from_gguf(qwen_gguf, name="tool_use")


def test_gemma_turn_format():
    tpl = ChatTemplate.builtin("gemma3", bos_token="<bos>", eos_token="<eos>")
    text = tpl.render([
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "  Hi there \n"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "ignored"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    ])
    assert text == (
        "<bos><start_of_turn>user\nBe kind.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_demo_gemma_file_gets_the_gemma_fallback():
    try:
        from minecart.engine.demo import demo_model_installed, demo_model_path
    except ImportError:
        pytest.skip("engine/demo.py not available")
    if not demo_model_installed():
        pytest.skip("demo model package not installed")
    gf = GGUFFile(demo_model_path())
    assert gf.get("tokenizer.chat_template") is None  # the demo file ships no template
    tpl = ChatTemplate.from_gguf(gf)
    assert "gemma3" in tpl.origin
    text = tpl.render([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_builtin_templates_are_packaged():
    for name in ("chatml", "chatml_qwen35", "gemma3"):
        assert "{%" in builtin_template_source(name)
    with pytest.raises(TemplateError, match="no built-in"):
        builtin_template_source("nope")


# ---------------------------------------------------------------------------- sandbox and errors


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match=r"syntax error at line 2"):
        ChatTemplate("ok\n{% if messages %}unclosed", origin="test")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set x = namespace() %}{% set x._hidden = 1 %}",
    "{{ messages.append({'role': 'user'}) }}",  # immutable sandbox: no mutating calls
])
def test_unsafe_templates_are_stopped(source):
    tpl = ChatTemplate(source, origin="evil")
    with pytest.raises(TemplateError, match="unsafe|not allowed|failed"):
        tpl.render([{"role": "user", "content": "hi"}])


def test_raise_exception_message_reaches_the_caller(qwen_template):
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        qwen_template.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(TemplateError, match="No messages provided"):
        qwen_template.render([])
    with pytest.raises(TemplateError, match="failed while rendering: UndefinedError"):
        ChatTemplate("{{ nothing.here }}").render([{"role": "user", "content": "a"}])


def test_helpers_tojson_strftime_generation_and_loop_controls():
    tpl = ChatTemplate(
        "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ strftime_now('%Y') }}|"
        "{% generation %}gen{% endgeneration %}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    data = {"a": "<ü&>", "b": [1, None]}
    out = tpl.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], data=data)
    compact, indented, year, gen, loop = out.split("|")
    assert compact == '{"a": "<ü&>", "b": [1, null]}'
    assert json.loads(indented) == data and "\n  " in indented
    assert year == str(datetime.now().year)
    assert gen == "gen" and loop == "one"


def test_bad_messages_are_rejected_with_a_clear_error():
    with pytest.raises(TemplateError, match="list"):
        normalize_messages("hello")
    with pytest.raises(TemplateError, match="message 1"):
        normalize_messages([{"role": "user", "content": "a"}, {"content": "no role"}])
    with pytest.raises(TemplateError, match="tools"):
        ChatTemplate.builtin("chatml").render([{"role": "user", "content": "a"}], tools=["get_weather"])


# ---------------------------------------------------------------------------------- split_thinking


@pytest.mark.parametrize("text, in_thinking, expected", [
    ("Let me think.\n</think>\n\nParis.", True, ("Let me think.", "Paris.")),
    ("<think>\nhmm\n</think>\n\nParis.", False, ("hmm", "Paris.")),
    ("<think>\nhmm\n</think>\n\nParis.", True, ("hmm", "Paris.")),
    ("still thinking about", True, ("still thinking about", "")),  # streaming, block not closed
    ("still thinking </thi", True, ("still thinking", "")),  # a tag cut in half is held back
    ("<think>\npartial", False, ("partial", "")),
    ("<thi", False, ("", "")),
    ("Just an answer.", False, ("", "Just an answer.")),
    ("\n</think>\n\nAnswer", True, ("", "Answer")),  # empty think block (enable_thinking=False)
    ("", True, ("", "")),
    ("a < b", False, ("", "a < b")),
])
def test_split_thinking(text, in_thinking, expected):
    assert split_thinking(text, in_thinking=in_thinking) == expected


def test_split_thinking_on_a_growing_stream():
    full = "Two plus two.\n</think>\n\nIt is 4."
    seen_reasoning = []
    for end in range(len(full) + 1):
        reasoning, answer = split_thinking(full[:end], in_thinking=True)
        assert "<" not in reasoning  # never shows a piece of the closing tag
        assert answer == "" or full[:end].endswith(answer)
        seen_reasoning.append(reasoning)
    assert seen_reasoning[-1] == "Two plus two." and answer == "It is 4."


def test_prompt_opens_thinking(qwen_template, sequences):
    assert prompt_opens_thinking(qwen_template.render(sequences["chat_messages"]))
    assert not prompt_opens_thinking(qwen_template.render(sequences["chat_messages"], enable_thinking=False))
    assert not prompt_opens_thinking("<start_of_turn>model\n")
