"""The one prompt renderer: (model, chat messages / text / token ids, tools, thinking, mode) -> token ids.

Every caller (the runtime, and through it the HTTP server and the desktop app; the CLI; the generate
loop) turns its prompt into tokens here, so a chat is rendered the same way wherever it comes from.

`render_prompt` returns a `RenderedPrompt`: the token ids, whether the prompt leaves a `<think>` block
open (Qwen3.5's generation prompt ends in "<think>\\n", so the model's first tokens are reasoning), and
the turn boundary (the number of tokens before the generation prompt; see
generation.checkpoint_turn_boundary). Chats with pictures are not tokenized here: engine/vision lays out
their ids, positions and image rows, so they come back as `messages` for the model to prepare.

Modes for chat messages (`PromptMode`, the CLI's `--chat-template`, the API's `chat_template_mode`):
- "on": the model's chat template (a file without one gets a built-in template by architecture);
- "off": plain completion: the messages' text as one document (messages_text), continued as written;
- "auto": "off" for a pretrained base model (it continues text; a chat turn it cannot follow makes
  it loop), "on" otherwise.
A prompt given as a string is always plain text, and token ids are used as they are.

What this file is not: the template engine (chat_template.py), the tokenizer (tokenizer.py), or the
picture layout (vision/insert.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .chat_template import prompt_opens_thinking
from .errors import MinecartError, RequestError
from .vision.insert import has_images

PromptMode = Literal["auto", "on", "off"]
PROMPT_MODES: tuple[PromptMode, ...] = ("auto", "on", "off")

Message = Mapping[str, Any]
PromptInput = str | Sequence[int] | Sequence[Message]

__all__ = ["PROMPT_MODES", "PromptMode", "RenderedPrompt", "check_prompt_mode", "has_images",
           "messages_text", "render_prompt"]


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatTemplateLike(Protocol):
    def render(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = ...,
               add_generation_prompt: bool = ..., enable_thinking: bool | None = ...) -> str: ...


class VocabConfig(Protocol):
    @property
    def vocab_size(self) -> int: ...  # rows of the token embedding


class PromptModel(Protocol):
    """What rendering needs from a model (engine.model.Model has it; so do the tests' fakes)."""

    @property
    def config(self) -> VocabConfig: ...

    @property
    def tokenizer(self) -> TokenizerLike | None: ...

    @property
    def chat_template(self) -> ChatTemplateLike | None: ...

    @property
    def is_base_model(self) -> bool: ...


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready for the generate loop."""

    ids: list[int]  # empty when `messages` is set
    opens_thinking: bool = False  # the prompt ends inside an open <think> block
    turn_boundary: int | None = None  # tokens before the generation prompt (chat mode, last turn user/tool)
    # "chat": rendered with the chat template, "text": plain text to continue, "ids": given as token ids
    source: Literal["chat", "text", "ids"] = "ids"
    # set instead of ids for chats with pictures (engine/vision lays them out) and for a model without a
    # chat template (generation.generate refuses them with a message)
    messages: list[dict[str, Any]] | None = None


def check_prompt_mode(mode: str) -> PromptMode:
    """`mode` as a PromptMode, or a RequestError naming the choices."""
    for m in PROMPT_MODES:
        if mode == m:
            return m
    raise RequestError(f"the chat template mode must be one of {', '.join(PROMPT_MODES)}, got "
                       f"{mode!r} (on: the chat template, off: plain text to continue, auto: off for "
                       "pretrained base models, on otherwise)")


def messages_text(messages: Sequence[Message]) -> str:
    """The plain text of chat messages for a model that continues text, as the document they form:
    an assistant message continues the text before it as it was generated (no separator), any other
    message starts a new paragraph (a blank line before it). Roles are not written; a picture cannot
    be, so it is refused."""
    text = ""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if any(isinstance(p, Mapping) and p.get("type") not in (None, "text") for p in content):
                raise RequestError("plain-text completion cannot carry pictures; turn the chat "
                                   "template on to send them to a model that reads them")
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        if not isinstance(content, str) or not content:
            continue
        if m.get("role") == "assistant" or not text:
            text += content
        else:
            text += "\n\n" + content
    return text


def _is_messages(prompt: PromptInput) -> bool:
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _tokenizer(model: PromptModel) -> TokenizerLike:
    tok = model.tokenizer
    if tok is None:
        raise RequestError("this model file has no tokenizer; pass the prompt as token ids")
    return tok


def _checked_ids(model: PromptModel, ids: Sequence[int]) -> list[int]:
    """Token ids given by a caller, each a row of the model's token embedding (a RequestError naming
    the first one that is not; the lookup would fail later with a bare IndexError), whether or not
    the file has a tokenizer."""
    out = [int(t) for t in ids]
    n = int(model.config.vocab_size)
    for t in out:
        if t < 0 or (n > 0 and t >= n):
            raise RequestError(f"token id {t} is outside the vocabulary"
                               + (f" (0..{n - 1})" if n > 0 else ""))
    return out


def render_prompt(model: PromptModel, prompt: PromptInput, *,
                  tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool = True,
                  mode: PromptMode = "on", find_turn_boundary: bool = False) -> RenderedPrompt:
    """Token ids for `prompt` (chat messages, text or token ids); see the module docstring for modes.

    find_turn_boundary: also compute the turn boundary of a templated chat whose last message is the
    user's (or a tool's) - one more render and encode, worth it only with a session to checkpoint."""
    if isinstance(prompt, str):
        if tools:
            raise RequestError("tools need chat messages rendered with the chat template")
        return RenderedPrompt(ids=list(_tokenizer(model).encode(prompt, add_special=True)),
                              source="text")
    if not _is_messages(prompt):
        return RenderedPrompt(ids=_checked_ids(model, prompt))  # type: ignore[arg-type]
    messages = [dict(m) for m in prompt]  # type: ignore[arg-type]
    if mode == "auto":
        mode = "off" if model.is_base_model else "on"
    if mode == "off":
        if tools:
            raise RequestError("tools need the chat template, but this prompt is plain text (the "
                               "default for a pretrained base model); turn the chat template on "
                               "to send them")
        text = messages_text(messages)
        ids = list(_tokenizer(model).encode(text, add_special=True)) if text else []
        return RenderedPrompt(ids=ids, source="text")
    template = model.chat_template
    if template is None:  # nothing to render here: the model gets the messages (and refuses them)
        return RenderedPrompt(ids=[], source="chat", messages=messages)
    text = template.render(messages, tools=tools or None, add_generation_prompt=True,
                           enable_thinking=enable_thinking)
    opens = prompt_opens_thinking(text)
    if has_images(messages):
        return RenderedPrompt(ids=[], opens_thinking=opens, source="chat", messages=messages)
    tok = _tokenizer(model)
    # add_special=True: the template's control tokens (<|im_start|>, <start_of_turn>) must become
    # their ids, and a BOS the template already wrote is not doubled.
    ids = [int(t) for t in tok.encode(text, add_special=True)]
    boundary = None
    if find_turn_boundary and messages[-1].get("role") in ("user", "tool"):
        boundary = _turn_boundary(template, tok, messages, tools, enable_thinking, text, ids)
    return RenderedPrompt(ids=ids, opens_thinking=opens, turn_boundary=boundary, source="chat")


def _turn_boundary(template: ChatTemplateLike, tok: TokenizerLike, messages: list[dict[str, Any]],
                   tools: Sequence[Mapping[str, Any]] | None, enable_thinking: bool, text: str,
                   ids: list[int]) -> int | None:
    """Tokens of the prompt before the generation prompt, when they are a prefix of its ids."""
    try:
        base = template.render(messages, tools=tools or None, add_generation_prompt=False,
                               enable_thinking=enable_thinking)
    except MinecartError:  # a template that insists on a generation prompt: no boundary, no error
        return None
    if not base or not text.startswith(base):
        return None
    base_ids = [int(t) for t in tok.encode(base, add_special=True)]
    if 0 < len(base_ids) < len(ids) and ids[: len(base_ids)] == base_ids:
        return len(base_ids)
    return None
