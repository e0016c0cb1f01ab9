"""Hostile chat templates (untrusted code from a GGUF): every one fails its own render with a
TemplateError, in about a second at most, without building a huge value, and the engine keeps serving.

Each case failed before its fix: nested range(100000) loops never ended and blocked every request,
`'x' * 10**9` rendered 1 GB, a doubling loop reached gigabytes and raised a bare MemoryError; huge
widths (center, ljust, format) and big-integer powers allocated or computed without limit.
"""

from __future__ import annotations

import threading
import time

import pytest
from minecart.engine import chat_template
from minecart.engine.chat_template import ChatTemplate
from minecart.engine.errors import TemplateError
from minecart.engine.runtime import Runtime
from minecart.engine.sampling import greedy_params

from tests.fuzz.gguf_forge import TYPE_IDS, Forged

HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLE = "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"

HOSTILE = {
    "nested ranges": (HANG + "x", "time budget"),
    "repeat 10**9": ("{{ 'x' * 10**9 }}", "a repeated string"),
    "doubling with ~": (DOUBLE.replace("OP", "~") + "{{ ns.s }}", "concatenation"),
    "doubling with +": (DOUBLE.replace("OP", "+") + "{{ ns.s }}", "concatenation"),
    "list repeat": ("{{ ([1] * 100000) * 100000 }}", "a repeated string or list"),
    "center 10**9": ("{{ 'x'|center(10**9) }}", "center"),
    "ljust 10**9": ("{{ 'x'.ljust(10**9) }}", "ljust"),
    "format filter width": ("{{ '%1000000000s'|format('x') }}", "format width"),
    "str.format width": ("{{ '{:1000000000}'.format('x') }}", "format width"),
    "percent width": ("{{ '%1000000000s' % 'x' }}", "format width"),
    "power": ("{{ 10 ** (10 ** 10) }}", "integer"),
    "squaring loop": ("{% set ns = namespace(n=10**1000) %}{% for i in range(40) %}"
                      "{% set ns.n = ns.n * ns.n %}{% endfor %}", "integer"),
    "replace blow-up": ("{{ ('x' * 10000).replace('', 'y' * 100000) }}", "replacement"),
    "join blow-up": ("{{ (['y' * 1000000] * 1000)|join('') }}", "join"),
    "output past the cap": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "rendered prompt"),
}


@pytest.mark.parametrize("source, fragment", HOSTILE.values(), ids=list(HOSTILE))
def test_a_hostile_template_fails_its_render_quickly(source, fragment):
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=fragment):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < chat_template.RENDER_BUDGET_S + 1.0


def test_a_memory_error_inside_a_template_is_a_template_error():
    class Exhausting:
        def __str__(self):
            raise MemoryError

    with pytest.raises(TemplateError, match="out of memory"):
        ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": Exhausting()}])


def test_a_stopped_render_leaves_no_thread_and_the_next_render_works():
    with pytest.raises(TemplateError, match="time budget"):
        ChatTemplate(HANG).render([{"role": "user", "content": "hi"}])
    deadline = time.monotonic() + 5
    while any(t.name == "minecart-template" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the stopped render thread is still running"
        time.sleep(0.01)
    ok = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
    assert ok.render([{"role": "user", "content": "hi"}]) == "user:hi"


def test_ordinary_templates_are_unaffected():
    # the sizes a real template works with pass: a long chat, tojson of tools, format of numbers
    src = ("{% for m in messages %}{{ '%-10s'|format(m.role) }}{{ m.content }}{% endfor %}"
           "{{ tools|tojson }}{{ 'ab' * 1000 }}{{ 2 ** 64 }}")
    text = ChatTemplate(src).render([{"role": "user", "content": "x" * 100_000}] * 50,
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    assert len(text) > 5_000_000 and text.endswith(str(2 ** 64))


@pytest.fixture(scope="module")
def hostile_runtime(fixtures_dir, tmp_path_factory):
    """The fixture model with a template that hangs when the last message says 'hang'."""
    src = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    template = ("{% if messages[-1].content == 'hang' %}" + HANG + "{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    path = Forged.from_file(src).set("tokenizer.chat_template", TYPE_IDS["STRING"], template).write(
        tmp_path_factory.mktemp("hostile") / "hostile-template.gguf")
    rt = Runtime(sample_memory_s=0)
    rt.load(path, devices=["cpu"]).result(120)
    yield rt
    rt.close()


def test_a_hanging_template_fails_its_request_and_the_engine_keeps_serving(hostile_runtime):
    rt = hostile_runtime
    t0 = time.perf_counter()
    final = rt.chat([{"role": "user", "content": "hang"}], greedy_params(max_tokens=2)).wait(60)
    assert final.kind == "error" and "time budget" in final.text, (final.kind, final.text)
    assert time.perf_counter() - t0 < 5
    assert rt.status()["alive"]
    for messages in ([{"role": "user", "content": "hello"}],):
        final = rt.chat(messages, greedy_params(max_tokens=2)).wait(60)
        assert final.kind == "done", final.text
    assert rt.complete("hello", greedy_params(max_tokens=2)).wait(60).kind == "done"
