"""The generate loop: prompt -> session prefill -> sample, feed, stream text, stop.

`generate(model, prompt, params, session=None, cancel=None, enable_thinking=True)` yields one
GenerationEvent per generated token; the last event carries finish_reason:
- "stop": an end-of-turn token (the tokenizer's EOS ids or params.stop_token_ids; the token itself is
  not fed to the model and adds no text) or a stop string (the text up to it is emitted, the rest not);
- "length": params.max_tokens tokens were generated, or the context is full (prompt + answer =
  the model's context_length; a prompt that leaves no room for an answer is a RequestError);
- "cancelled": `cancel` (a threading.Event) was set; checked before every token, so it takes effect
  within one token. That final event has token None.
Nothing is yielded after a final event. Text that could be the start of a stop string is held back
until it is clearly not one; incomplete UTF-8 sequences are held back until complete.

The prompt is token ids, a string (tokenized), or chat messages (rendered with the model's template).
With a session, the longest common prefix of its history is reused (Session.sync); the session
checkpoints itself after the prompt and at the end, so regenerate / edit-and-resend are cheap.

What this file is not: a request queue (runtime.py), a chat-format parser, or the sampler (sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import GenerationCancelled, RequestError
from .sampling import Sampler, SamplingParams
from .session import PREFILL_CHUNK

__all__ = ["GenerationEvent", "SamplingParams", "generate"]


@dataclass(frozen=True)
class GenerationEvent:
    """One generated token (or the final cancelled event) with running statistics."""

    token: int | None
    text: str  # new visible text since the previous event
    finish_reason: str | None  # None, "stop", "length", "cancelled"
    prompt_tokens: int
    generated_tokens: int
    prompt_tps: float | None  # prompt tokens computed / prefill seconds (None when all were cached)
    generation_tps: float | None  # generated tokens / seconds since the first token was sampled
    elapsed: float  # seconds since generate started
    cached_tokens: int = 0  # prompt tokens reused from the session
    image_tokens: int = 0  # prompt tokens that are image embeddings (engine/vision)

    @property
    def completion_tokens(self) -> int:  # the OpenAI name of generated_tokens
        return self.generated_tokens


class TextStream:
    """Incremental detokenizer over any `decode(ids) -> str`: decodes a short window of recent ids and
    emits only the new, complete characters (a trailing U+FFFD means an unfinished UTF-8 sequence)."""

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an unfinished sequence decodes with replacement characters)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class StopStrings:
    """Cuts text at the first stop string; holds back a tail that may still grow into one."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def prompt_ids(model, prompt, enable_thinking: bool = True) -> list[int]:
    """Token ids for a prompt given as ids, text, or chat messages."""
    name = getattr(getattr(model, "path", None), "name", None) or "this model"
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise RequestError(f"{name} has no tokenizer; pass token ids")
        return [int(t) for t in model.tokenizer.encode(prompt, add_special=True)]
    items = list(prompt)
    if items and isinstance(items[0], dict):
        if model.chat_template is None or model.tokenizer is None:
            raise RequestError(f"{name} has no chat template or tokenizer; pass token ids "
                               "(or text, if it has a tokenizer)")
        text = model.chat_template.render(items, add_generation_prompt=True,
                                          enable_thinking=enable_thinking)
        # add_special=True: the rendered template's <|im_start|>/<start_of_turn> must become single
        # special ids (a BOS the template already wrote is not doubled)
        return [int(t) for t in model.tokenizer.encode(text, add_special=True)]
    return [int(t) for t in items]


def context_limit(model) -> int:
    """The most tokens (prompt + answer) one sequence may hold: the model's trained context length
    (0 = unknown, no limit). Past it the KV cache would still grow, but the model's output is garbage."""
    return int(getattr(getattr(model, "config", None), "context_length", 0) or 0)


def check_fits_context(model, n_prompt: int) -> None:
    limit = context_limit(model)
    if limit and n_prompt >= limit:
        name = getattr(getattr(model, "path", None), "name", None) or "the model"
        raise RequestError(f"the prompt is {n_prompt:,} tokens, but {name} holds at most {limit:,} "
                           "(its context length) including the answer; shorten the prompt or the "
                           "conversation, or start a new chat")


def _eos_ids(tokenizer) -> set[int]:
    if tokenizer is None:
        return set()
    ids = getattr(tokenizer, "eos_ids", None)
    if callable(ids):
        ids = ids()
    return {int(t) for t in (ids or ())}


def generate(model, prompt, params: SamplingParams | None = None, *, session=None, cancel=None,
             enable_thinking: bool = True, prefill_chunk: int = PREFILL_CHUNK, positions=None,
             embed_override=None, tools=None, turn_boundary: int | None = None
             ) -> Iterator[GenerationEvent]:
    """positions ((3, T) M-RoPE) and embed_override ((rows, values) image embeddings) describe a
    prompt given as token ids with images already expanded (Session.sync); text gets positions
    continuing from the prompt's last one. Chat messages with pictures on a model with a vision tower
    are laid out by engine/vision (prepare_chat), `tools` rendered into their template.

    turn_boundary: for a chat prompt given as ids with a session, the number of tokens before the
    generation prompt; the session is checkpointed there first (see checkpoint_turn_boundary). Every
    check on the prompt (empty, beyond the context) runs before any token is computed."""
    params = params or SamplingParams()
    if positions is None and embed_override is None and getattr(model, "vision", None) is not None:
        from .vision.insert import has_images, prepare_chat

        if has_images(prompt):  # chat messages with pictures: expanded ids, (3, T) positions, rows
            from .vision.insert import checkpoint_turn_boundary as checkpoint_image_turn

            prepared = prepare_chat(model, prompt, enable_thinking=enable_thinking, tools=tools)
            check_fits_context(model, len(prepared.ids))
            positions, embed_override = prepared.positions, prepared.embed_override
            before = None
            if session is not None:
                def before():
                    return checkpoint_image_turn(session, prepared, cancel)
            return _generate(model, prepared.ids, params, session, cancel, prefill_chunk, positions,
                             embed_override, image_tokens=prepared.n_image_tokens, before_prompt=before)
    ids = prompt_ids(model, prompt, enable_thinking)
    if not ids:
        raise RequestError("the prompt is empty")
    check_fits_context(model, len(ids))
    before = None
    if session is not None and turn_boundary and 0 < turn_boundary < len(ids):
        boundary_ids = ids[:turn_boundary]

        def before():
            return checkpoint_turn_boundary(session, boundary_ids, cancel, prefill_chunk)
    return _generate(model, ids, params, session, cancel, prefill_chunk, positions, embed_override,
                     before_prompt=before)


def checkpoint_turn_boundary(session, ids: list[int], cancel=None, chunk: int = PREFILL_CHUNK) -> int:
    """Run the prompt up to the end of the last user message and checkpoint the session there;
    returns the tokens computed (0 when the session has no recurrent state or had them already).

    Why: a hybrid model's recurrent (Gated DeltaNet) state cannot be rewound, only restored from a
    snapshot. The next turn re-renders this turn's assistant message without the generation prompt's
    `<think>` block (Qwen3.5 drops past thinking), so its tokens diverge right after this boundary;
    with a snapshot here the next turn reuses everything up to it instead of starting from zero.
    Chunked and cancellable like every prefill; called only after the prompt passed its checks."""
    if not session.has_recurrent_state:
        return 0
    if session.has_snapshot(ids):
        # Checkpointed on an earlier pass (regenerate): running back to the boundary now would
        # throw away the later snapshot of the whole prompt and recompute the last message.
        return 0
    session.sync(ids, chunk=chunk, cancel=cancel)
    computed = int(session.computed_tokens)
    session.checkpoint()
    return computed


def _generate(model, ids, params, session, cancel, prefill_chunk, positions=None, embed_override=None,
              image_tokens: int = 0, before_prompt=None):
    t0 = time.perf_counter()
    session = session if session is not None else model.new_session()
    tokenizer = model.tokenizer
    end_ids = _eos_ids(tokenizer) | set(params.stop_token_ids)
    n_prompt = len(ids)
    limit = context_limit(model)
    stats = {"computed": 0, "prefill_s": 0.0, "decode_t0": None, "n_gen": 0}

    def event(token, text, finish=None):
        now = time.perf_counter()
        n_gen = stats["n_gen"]
        decode_s = now - stats["decode_t0"] if stats["decode_t0"] is not None else 0.0
        return GenerationEvent(
            token=token,
            text=text,
            finish_reason=finish,
            prompt_tokens=n_prompt,
            generated_tokens=n_gen,
            prompt_tps=stats["computed"] / stats["prefill_s"] if stats["computed"] and stats["prefill_s"] > 0 else None,
            generation_tps=n_gen / decode_s if n_gen and decode_s > 0 else None,
            elapsed=now - t0,
            cached_tokens=n_prompt - stats["computed"],
            image_tokens=image_tokens,
        )

    if cancel is not None and cancel.is_set():
        yield event(None, "", "cancelled")
        return
    try:
        extras = {}
        if positions is not None or embed_override is not None:
            extras = {"positions": positions, "embed_override": embed_override}
        pre_computed = before_prompt() if before_prompt is not None else 0  # turn-boundary snapshot
        logits = session.sync(ids, chunk=prefill_chunk, cancel=cancel, **extras)
    except GenerationCancelled:
        yield event(None, "", "cancelled")
        return
    stats["computed"] = session.computed_tokens + pre_computed
    stats["prefill_s"] = time.perf_counter() - t0
    session.checkpoint()  # turn boundary: regenerate restarts from here

    sampler = Sampler(params, ids)
    text = TextStream(tokenizer.decode) if tokenizer is not None else None
    stops = StopStrings(params.stop)
    stats["decode_t0"] = time.perf_counter()

    def held_text() -> str:
        tail = text.flush() if text is not None else ""
        shown, _ = stops.feed(tail)
        return shown + stops.flush()

    try:
        if params.max_tokens == 0:
            yield event(None, "", "length")
            return
        while True:
            if cancel is not None and cancel.is_set():
                yield event(None, held_text(), "cancelled")
                return
            token = sampler(logits)
            stats["n_gen"] += 1
            if token in end_ids:
                yield event(token, held_text(), "stop")
                return
            delta = text.add(token) if text is not None else ""
            shown, hit = stops.feed(delta)
            if hit:
                yield event(token, shown, "stop")
                return
            # the context is full once the prompt and the answer so far leave no room for this token
            if stats["n_gen"] >= params.max_tokens or (limit and n_prompt + stats["n_gen"] >= limit):
                yield event(token, shown + held_text(), "length")
                return
            yield event(token, shown)
            if cancel is not None and cancel.is_set():
                yield event(None, held_text(), "cancelled")
                return
            logits = session.step(token)
    finally:
        session.checkpoint()
