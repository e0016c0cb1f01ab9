"""The generate loop: prompt -> session prefill -> sample, feed, stream text, stop.

`generate(model, prompt, params, session=None, cancel=None, enable_thinking=True)` yields one
GenerationEvent per generated token; the last event carries finish_reason:
- "stop": an end-of-turn token (the tokenizer's EOS ids or params.stop_token_ids; the token itself is
  not fed to the model and adds no text) or a stop string (the text up to it is emitted, the rest not);
- "length": params.max_tokens tokens were generated, or the context is full (prompt + answer =
  the context limit, engine/session.py context_limit: the planned context; a prompt that leaves no
  room for an answer is a ContextFullError, a RequestError, raised before any token is computed);
- "cancelled": `cancel` (a threading.Event) was set; checked before every token, so it takes effect
  within one token. That final event has token None.
Nothing is yielded after a final event. Text that could be the start of a stop string is held back
until it is clearly not one; incomplete UTF-8 sequences are held back until complete.

The prompt is token ids, a string (tokenized), or chat messages, all turned into ids by engine/prompt.py
(chat messages with the model's template unless `mode` says otherwise). Without params.max_tokens the
length is the engine's default for the prompt (sampling.SamplingParams.resolved_max_tokens).
With a session, the longest common prefix of its history is reused (Session.sync); the session
checkpoints itself after the prompt and at the end, so regenerate / edit-and-resend are cheap.

What this file is not: a request queue (runtime.py), a chat-format parser, or the sampler (sampling.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GenerationCancelled, RequestError
from .execution import shift_override
from .prompt import PromptInput, PromptMode, render_prompt
from .sampling import LaunchedStep, Sampler, SamplingParams, TopLogits, log_softmax_at
from .session import PREFILL_CHUNK, Session, context_full, context_limit
from .vision.insert import has_images as has_images_in
from .vision.insert import prepare_chat

if TYPE_CHECKING:  # model.py imports this module to run Model.generate
    from .model import Model
    from .tokenizer import Tokenizer

__all__ = ["GenerationEvent", "SamplingParams", "StopStrings", "TextStream", "generate"]


@dataclass(frozen=True)
class TokenChoice:
    """A token with its bytes and its log-probability under the model."""

    token: int
    data: bytes
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)


@dataclass(frozen=True)
class TokenLogprobs:
    """The generated token's TokenChoice and its row's most likely tokens (SamplingParams.logprobs of
    them, descending)."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


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
    # the token's log-probabilities when SamplingParams.logprobs asked for them (never for an end token)
    logprobs: TokenLogprobs | None = None
    # on the first event only, when SamplingParams.prompt_logprobs asked for them: each prompt token's
    # log-probabilities given the tokens before it (the first one's logprob None)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def completion_tokens(self) -> int:  # the OpenAI name of generated_tokens
        return self.generated_tokens


class TextStream:
    """Incremental detokenizer over any `decode(ids) -> str`: decodes a short window of recent ids and
    emits only the new, complete characters (a trailing U+FFFD means an unfinished UTF-8 sequence)."""

    def __init__(self, decode: Callable[[list[int]], str]):
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
    """Cuts streamed text at the first stop string; holds back a tail that may still grow into one
    (so "STO" is not shown before "P" arrives). The one stop-string matcher: the generate loop uses it
    on the whole output, the runtime on the answer (a client's stop strings do not cut thinking)."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit). Nothing shows after a hit."""
        if self.hit:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            self.hit = True
            return buf[: min(hits)], True
        keep = max(partial_suffix(buf, s) for s in self.stops)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of the stream (nothing after a hit)."""
        out, self.held = self.held, ""
        return "" if self.hit else out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def check_fits_context(model: Model, n_prompt: int, session: Session | None = None) -> None:
    """Refuse a prompt that leaves no room for one answer token within the context limit (the
    session's, else the model's: engine/session.py context_limit), before any token is computed."""
    limit = session.limit if session is not None else context_limit(model)
    if n_prompt >= limit:
        raise context_full(n_prompt + 1, limit, int(model.config.context_length or 0))


def generate(model: Model, prompt: PromptInput, params: SamplingParams | None = None, *,
             session: Session | None = None, cancel: threading.Event | None = None,
             enable_thinking: bool = True, prefill_chunk: int = PREFILL_CHUNK,
             positions: np.ndarray | None = None, embed_override: Any = None,
             tools: Sequence[Mapping[str, Any]] | None = None, turn_boundary: int | None = None,
             mode: PromptMode = "on") -> Iterator[GenerationEvent]:
    """positions ((3, T) M-RoPE) and embed_override ((rows, values) image embeddings) describe a
    prompt given as token ids with images already expanded (Session.sync); text gets positions
    continuing from the prompt's last one. Chat messages with pictures on a model with a vision tower
    are laid out by engine/vision (prepare_chat), `tools` rendered into their template. Chat messages
    are rendered by engine/prompt.py in `mode` (default: the chat template).

    turn_boundary: for a chat prompt given as ids with a session, the number of tokens before the
    generation prompt; the session is checkpointed there first (see checkpoint_turn_boundary). Every
    check on the prompt (empty, beyond the context) runs before any token is computed."""
    params = params or SamplingParams()
    if positions is None and embed_override is None and model.vision is not None \
            and not isinstance(prompt, str) and has_images_in(prompt):
        # chat messages with pictures: expanded ids, (3, T) positions, embedding rows
        prepared = prepare_chat(model, prompt, enable_thinking=enable_thinking, tools=tools)
        check_fits_context(model, len(prepared.ids), session)
        before: Callable[[], int] | None = None
        b = prepared.boundary
        if session is not None and b:
            image_session = session

            def before() -> int:
                return checkpoint_turn_boundary(
                    image_session, prepared.ids[:b], cancel, prefill_chunk,
                    positions=prepared.positions[:, :b],
                    embed_override=shift_override(prepared.embed_override, 0, b))
        return _generate(model, prepared.ids, params.with_max_tokens(templated=True), session,
                         cancel, prefill_chunk,
                         prepared.positions, prepared.embed_override,
                         image_tokens=prepared.n_image_tokens, before_prompt=before)
    rendered = render_prompt(model, prompt, tools=tools, enable_thinking=enable_thinking, mode=mode)
    if rendered.messages is not None and has_images_in(rendered.messages):
        raise RequestError("this model cannot read pictures (it has no vision encoder); remove the "
                           "image or load a vision model together with its mmproj file")
    if rendered.messages is not None:
        raise RequestError(f"{model.path.name} has no chat template; send plain text (a completion) "
                           "or token ids")
    ids = rendered.ids
    if not ids:
        raise RequestError("the prompt is empty")
    # a default length for the kind of prompt: plain text continues, ids and chats answer
    params = params.with_max_tokens(templated=rendered.source != "text")
    check_fits_context(model, len(ids), session)
    before = None
    if session is not None and turn_boundary and 0 < turn_boundary < len(ids):
        boundary_ids = ids[:turn_boundary]
        text_session = session

        def before() -> int:
            return checkpoint_turn_boundary(text_session, boundary_ids, cancel, prefill_chunk)
    return _generate(model, ids, params, session, cancel, prefill_chunk, positions, embed_override,
                     before_prompt=before)


def checkpoint_turn_boundary(session: Session, ids: list[int], cancel: threading.Event | None = None,
                             chunk: int = PREFILL_CHUNK, *, positions: np.ndarray | None = None,
                             embed_override: Any = None) -> int:
    """Run the prompt up to the end of the last user message and checkpoint the session there;
    returns the tokens computed (0 when the session has no recurrent state or had them already).
    positions / embed_override: those of `ids` for a prompt with pictures (their rows match only
    the same pictures, see Session.sync).

    Why: a hybrid model's recurrent (Gated DeltaNet) state cannot be rewound, only restored from a
    snapshot. The next turn re-renders this turn's assistant message without the generation prompt's
    `<think>` block (Qwen3.5 drops past thinking), so its tokens diverge right after this boundary;
    with a snapshot here the next turn reuses everything up to it instead of starting from zero.
    Chunked and cancellable like every prefill; called only after the prompt passed its checks."""
    if not session.has_recurrent_state:
        return 0
    if session.has_snapshot(ids, embed_override):
        # Checkpointed on an earlier pass (regenerate): running back to the boundary now would
        # throw away the later snapshot of the whole prompt and recompute the last message.
        return 0
    session.sync(ids, chunk=chunk, cancel=cancel, positions=positions, embed_override=embed_override)
    computed = int(session.computed_tokens)
    session.checkpoint()
    return computed


@dataclass
class _Clock:
    """Running counters of one generation, for its events."""

    t0: float
    n_prompt: int
    image_tokens: int
    computed: int = 0  # prompt tokens computed (not reused from the session)
    prefill_s: float = 0.0
    decode_t0: float | None = None
    n_gen: int = 0
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # handed to the next event, once

    def event(self, token: int | None, text: str, finish: str | None = None,
              logprobs: TokenLogprobs | None = None) -> GenerationEvent:
        now = time.perf_counter()
        decode_s = now - self.decode_t0 if self.decode_t0 is not None else 0.0
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return GenerationEvent(
            token=token,
            text=text,
            finish_reason=finish,
            prompt_tokens=self.n_prompt,
            generated_tokens=self.n_gen,
            prompt_tps=self.computed / self.prefill_s if self.computed and self.prefill_s > 0 else None,
            generation_tps=self.n_gen / decode_s if self.n_gen and decode_s > 0 else None,
            elapsed=now - self.t0,
            cached_tokens=self.n_prompt - self.computed,
            image_tokens=self.image_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def _token_logprobs(logits: np.ndarray | TopLogits, token: int, n: int, tokenizer: Tokenizer | None) -> TokenLogprobs:
    """`token`'s log-probability under the row it was drawn from, and the row's n most likely tokens."""
    row = logits.whole_row() if isinstance(logits, TopLogits) else np.asarray(logits).reshape(-1)
    lp, alts = log_softmax_at(row, token, n)
    return TokenLogprobs(_choice(token, lp, tokenizer), tuple(_choice(t, v, tokenizer) for t, v in alts))


def _choice(token: int, value: float | None, tokenizer: Tokenizer | None) -> TokenChoice:
    data = tokenizer.token_bytes(token) if tokenizer is not None else b""
    return TokenChoice(token, data, None if value is None else max(value, LOGPROB_FLOOR))


def _scored_prompt(session: Session, ids: list[int], n: int, tokenizer: Tokenizer | None,
                   cancel: threading.Event | None) -> tuple[np.ndarray, tuple[TokenLogprobs, ...]]:
    """The prompt run from an empty history with every position's logits (Session.score): the logits
    after it, and each prompt token's log-probabilities given the tokens before it."""
    out = [TokenLogprobs(_choice(ids[0], None, tokenizer))]

    def on_rows(start: int, rows: np.ndarray) -> None:
        for r in range(rows.shape[0]):
            if start + r + 1 < len(ids):
                out.append(_token_logprobs(rows[r], ids[start + r + 1], n, tokenizer))

    logits = session.score(ids, on_rows, cancel=cancel)
    assert logits is not None  # ids is not empty
    return logits, tuple(out)


# A log-probability below this (a logit of -inf) is reported as this, so that it stays a JSON number
LOGPROB_FLOOR = -9999.0


def _generate(model: Model, ids: list[int], params: SamplingParams, session: Session | None,
              cancel: threading.Event | None, prefill_chunk: int, positions: np.ndarray | None = None,
              embed_override: Any = None, image_tokens: int = 0,
              before_prompt: Callable[[], int] | None = None) -> Iterator[GenerationEvent]:
    clock = _Clock(time.perf_counter(), len(ids), image_tokens)
    session = session if session is not None else model.new_session()
    tokenizer = model.tokenizer
    end_ids = (set(tokenizer.eos_ids) if tokenizer is not None else set()) | set(params.stop_token_ids)
    limit = session.limit

    far = max((t for t, _ in params.logit_bias), default=-1)
    if far >= model.config.vocab_size:
        raise RequestError(f"logit_bias names token {far}, outside the vocabulary (0..{model.config.vocab_size - 1})")
    grammar = None
    if params.answer_format is not None:  # the answer's format, checked before any token is computed
        if tokenizer is None:
            raise RequestError(f"an answer format ({params.answer_format.label}) needs the model's tokenizer; "
                               "this model has none")
        grammar = params.answer_format.matcher(tokenizer, end_ids, ids)
    if cancel is not None and cancel.is_set():
        yield clock.event(None, "", "cancelled")
        return
    logits: np.ndarray | TopLogits
    try:
        pre_computed = before_prompt() if before_prompt is not None else 0  # turn-boundary snapshot
        if params.prompt_logprobs is not None:
            if positions is not None or embed_override is not None:
                raise RequestError("prompt log-probabilities (echo) are for text prompts, not pictures")
            logits, clock.prompt_logprobs = _scored_prompt(session, ids, params.prompt_logprobs, tokenizer,
                                                           cancel)
        elif positions is not None or embed_override is not None:
            logits = session.sync(ids, chunk=prefill_chunk, cancel=cancel, positions=positions,
                                  embed_override=embed_override)
        else:
            logits = session.sync(ids, chunk=prefill_chunk, cancel=cancel)
    except GenerationCancelled:
        yield clock.event(None, "", "cancelled")
        return
    clock.computed = session.computed_tokens + pre_computed
    clock.prefill_s = time.perf_counter() - clock.t0
    session.checkpoint()  # turn boundary: regenerate restarts from here

    max_tokens = params.resolved_max_tokens(templated=True)  # resolved by generate already
    sampler = Sampler(params, ids, vocab=model.config.vocab_size,  # penalties applied on the device too
                      grammar=grammar)
    text = TextStream(tokenizer.decode) if tokenizer is not None else None
    stops = StopStrings(params.stop)
    clock.decode_t0 = time.perf_counter()

    def held_text() -> str:
        tail = text.flush() if text is not None else ""
        shown, _ = stops.feed(tail)
        return shown + stops.flush()

    # greedy or top-k (penalties applied on the device): the device draws each pick and feeds it to the
    # next step itself, one step ahead (the uniform numbers in the sampler's order: Sampler.pick_spec)
    chain = sampler.chains
    ahead: LaunchedStep | None = None  # the step of the token about to be picked, launched already
    try:
        if max_tokens == 0:
            yield clock.event(None, "", "length")
            return
        while True:
            if cancel is not None and cancel.is_set():
                yield clock.event(None, held_text(), "cancelled")
                return
            token = sampler(logits)
            clock.n_gen += 1
            if token in end_ids:
                yield clock.event(token, held_text(), "stop")
                return
            lp = None if params.logprobs is None else _token_logprobs(logits, token, params.logprobs, tokenizer)
            delta = text.add(token) if text is not None else ""
            shown, hit = stops.feed(delta)
            if hit:
                yield clock.event(token, shown, "stop", lp)
                return
            # the context is full once the prompt and the answer so far leave no room for this token
            if clock.n_gen >= max_tokens or clock.n_prompt + clock.n_gen >= limit:
                yield clock.event(token, shown + held_text(), "length", lp)
                return
            # the token goes on: its step is launched before its event is handed out, so the device
            # computes while the consumer shows or sends the token (the same steps as stepping after)
            if ahead is not None and session.tokens[-1] != token:
                raise RuntimeError(f"the device fed token {session.tokens[-1]} where the pick was {token}")
            launched = ahead if ahead is not None else \
                session.launch_step(token, top=sampler.candidates, pick=sampler.pick_spec(0))
            ahead = None
            # and, where the device picks, the step of the next pick behind it, unless that pick is the
            # last token (an end token found then leaves one step run past the answer, which the next
            # turn either reuses or rewinds)
            if chain and clock.n_gen + 1 < max_tokens and clock.n_prompt + clock.n_gen + 1 < limit:
                spec = sampler.pick_spec(1)
                assert spec is not None  # the sampler chains
                ahead = session.launch_next(launched, top=sampler.candidates, pick=spec)
            yield clock.event(token, shown, logprobs=lp)
            if cancel is not None and cancel.is_set():
                launched.result()  # the session's states are settled before the loop ends
                yield clock.event(None, held_text(), "cancelled")
                return
            logits = launched.result()
    finally:
        try:
            session.checkpoint()
        except GenerationCancelled:
            if ahead is None:
                raise
            # a step launched ahead of the answer's end was cancelled (a scheduler shut down): the
            # generation ends here anyway, with its own outcome
