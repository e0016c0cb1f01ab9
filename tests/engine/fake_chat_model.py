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


@dataclass(frozen=True)
class FakeConfig:
    name: str = "fake-chat"
    architecture: str = "fake"
    context_length: int = 4096


@dataclass(frozen=True)
class FakeEvent:
    token: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float


@dataclass
class FakeParams:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None


class ByteTokenizer:
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no BOS, like Qwen's tokenizer

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TinyTemplate:
    def render(self, messages, tools=None, add_generation_prompt=True, enable_thinking=True):
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


class FakeModel:
    """`reply(prompt_text, enable_thinking) -> str` scripts the output; `delay_s` per token."""

    def __init__(self, reply=None, delay_s: float = 0.0, fail_after: int | None = None):
        self.config = FakeConfig()
        self.tokenizer = ByteTokenizer()
        self.chat_template = TinyTemplate()
        self.reply = reply or default_reply
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.placement = None
        self.devices = ["cpu"]
        self.has_vision = True  # image parts are rendered as "<image>" by TinyTemplate
        self.generate_threads: set[int] = set()
        self.active = 0
        self.max_active = 0
        self.prompts: list = []
        self.sessions_made = 0
        self.closed = False
        self._lock = threading.Lock()

    def new_session(self) -> FakeSession:
        self.sessions_made += 1
        return FakeSession()

    def reload_placement(self, placement, *, progress=None, cancel=None) -> None:
        if progress:
            progress(1.0, "moved")
        self.placement = placement

    def close(self) -> None:
        self.closed = True

    def generate(self, prompt, params=None, session=None, cancel=None, enable_thinking=True):
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
        max_tokens = getattr(params, "max_tokens", None) or 256
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
        m.devices = list(devices or ["cpu"])
        m.placement = placement
        made.append(m)
        return m

    load.made = made
    return load
