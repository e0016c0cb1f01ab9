"""A small fake model with the interface the runtime, server and CLI use (nanochat style).

It is not a language model: it "answers" with a scripted reply, one character per token, with a byte-level
tokenizer and a tiny ChatML-like template that opens `<think>` when thinking is on. It records what the
runtime asked of it (threads, sessions, prefix reuse, cancellation) so tests can check the runtime, not
the maths. The real engine is exercised separately on the fixture GGUF.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from minecart.engine.errors import GenerationCancelled
from minecart.engine.generation import GenerationEvent
from minecart.engine.sampling import SamplingParams


@dataclass(frozen=True)
class FakeConfig:
    name: str = "fake-chat"
    architecture: str = "fake"
    context_length: int = 4096
    vocab_size: int = 256  # the byte tokenizer's ids


def FakeEvent(token: int, text: str, finish_reason: str | None, prompt_tokens: int,
              generated_tokens: int, prompt_tps: float | None, generation_tps: float | None
              ) -> GenerationEvent:
    """The engine's GenerationEvent from the few fields a scripted reply knows."""
    return GenerationEvent(token=token, text=text, finish_reason=finish_reason,
                           prompt_tokens=prompt_tokens, generated_tokens=generated_tokens,
                           prompt_tps=prompt_tps, generation_tps=generation_tps, elapsed=0.0)


class ByteTokenizer:
    eos_ids = frozenset()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no BOS, like Qwen's tokenizer

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TinyTemplate:
    def render(self, messages, *, tools=None, add_generation_prompt=True, enable_thinking=True):
        parts = []
        if tools:
            parts.append("<|system|>tools: " + ",".join(t["function"]["name"] for t in tools) + "\n")
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") if p.get("type") == "text" else "<image>" for p in content
                )
            parts.append(f"<|{m['role']}|>{content or ''}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>" + ("<think>\n" if enable_thinking else ""))
        return "".join(parts)


@dataclass
class FakeSession:
    tokens: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)  # prefix length reused at each generate
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def default_reply(prompt_text: str, enable_thinking: bool) -> str:
    answer = f"echo[{len(prompt_text)}]"
    if enable_thinking:
        return f"I should echo.\n</think>\n\n{answer}"
    return answer


class FakeModelBase:
    """The typed model interface the runtime reads (engine.runtime.RuntimeModel) with fake values."""

    is_base_model = False

    def __init__(self, name: str = "fake-chat"):
        self.config = FakeConfig(name=name)
        self.tokenizer = ByteTokenizer()
        self.chat_template: TinyTemplate | None = TinyTemplate()
        self.vision: object | None = None
        self.placement = None
        self.device_plan = {"global": "cpu"}
        self.closed = False

    def new_session(self):
        return FakeSession()

    def reload_placement(self, placement, *, progress=None, cancel=None) -> None:
        if progress:
            progress(1.0, "moved")
        self.placement = placement

    def close(self) -> None:
        self.closed = True


class FakeModel(FakeModelBase):
    """`reply(prompt_text, enable_thinking) -> str` scripts the output; `delay_s` per token."""

    def __init__(self, reply=None, delay_s: float = 0.0, fail_after: int | None = None):
        super().__init__()
        self.reply = reply or default_reply
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.vision = "fake vision tower"  # image parts are rendered as "<image>" by TinyTemplate
        self.generate_threads: set[int] = set()
        self.active = 0
        self.max_active = 0
        self.prompts: list = []
        self.generate_extras: list[dict] = []  # the keyword arguments of each generate call
        self.sessions_made = 0
        self._lock = threading.Lock()

    def new_session(self) -> FakeSession:
        self.sessions_made += 1
        return FakeSession()

    def generate(self, prompt, params: SamplingParams | None = None, session=None, cancel=None,
                 enable_thinking=True, **prompt_extras):
        self.generate_extras.append(prompt_extras)
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.generate_threads.add(threading.get_ident())
        try:
            yield from self._generate(prompt, params, session, cancel, enable_thinking)
        finally:
            with self._lock:
                self.active -= 1

    def _generate(self, prompt, params, session, cancel, enable_thinking):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            text = self.chat_template.render(prompt, enable_thinking=enable_thinking)
            ids = self.tokenizer.encode(text, add_special=False)
        else:
            ids = list(prompt)
            text = self.tokenizer.decode(ids)
        self.prompts.append(text)
        session = session if session is not None else self.new_session()
        common = 0
        for a, b in zip(session.tokens, ids, strict=False):
            if a != b:
                break
            common += 1
        session.reused.append(common)
        session.tokens = list(ids)
        max_tokens = (params or SamplingParams()).resolved_max_tokens(templated=True)
        out = self.reply(text, enable_thinking)
        for i, ch in enumerate(out):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("cancelled")
            if self.fail_after is not None and i >= self.fail_after:
                raise ValueError("fake engine failure")
            if self.delay_s:
                time.sleep(self.delay_s)
            token = ord(ch) % 256
            session.tokens.append(token)
            n = i + 1
            last = i == len(out) - 1
            reason = "length" if n >= max_tokens and not last else ("stop" if last else None)
            yield FakeEvent(token, ch, reason, len(ids), n, 1000.0, 100.0)
            if reason:
                return


def fake_loader(model: FakeModel | None = None, progress_steps: int = 4, delay_s: float = 0.0):
    """A loader with load_model's signature that reports progress and honours cancel."""
    made: list[FakeModel] = []

    def load(path, devices=None, placement=None, progress=None, cancel=None):
        if "missing" in str(path):
            from minecart.engine.errors import GGUFError

            raise GGUFError(path, "no such file; check the path")
        for k in range(progress_steps):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("load cancelled")
            if delay_s:
                time.sleep(delay_s)
            if progress:
                progress((k + 1) / progress_steps, f"layer {k}")
        m = model if model is not None else FakeModel()
        m.device_plan = {"global": (devices or ["cpu"])[0]}
        m.placement = placement
        made.append(m)
        return m

    load.made = made
    return load
