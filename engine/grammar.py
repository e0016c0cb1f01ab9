"""Token-level side of the answer formats: which tokens a byte-level recognizer lets come next.

A format (engine/json_output.py JSON, engine/tool_call_grammar.py forced tool calls) is a recognizer of
byte strings: `initial()` states, `advance(states, data)` (empty: `data` leaves the language) and
`accepts_end(states)`. `ByteMatcher` holds one generation's states and answers the sampler's questions
(engine/sampling.py Sampler._pick_allowed): is this token allowed, which of these are, which tokens of a
whole row in rank order; `feed` moves it on by the token drawn. A token is allowed when its bytes keep
the answer inside the language; an end token only once the answer may end there.

Which tokens are text: `TokenTable` (Tokenizer.text_token_bytes: control, user-defined and unused tokens
have no bytes), plus `literals`, special tokens a format spells out (Qwen's `<tool_call>`), by their
text. When the prompt leaves a `<think>` block open, the reasoning runs unconstrained (no end token, so
the model has to close the block) and the format starts after `</think>`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

THINK_OPEN, THINK_CLOSE = b"<think>", b"</think>"


class TokenSource(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def text_token_bytes(self) -> list[bytes]: ...

    def id_of(self, text: str) -> int | None: ...


class Recognizer(Protocol):
    def initial(self) -> frozenset[Any]: ...

    def advance(self, states: frozenset[Any], data: bytes) -> frozenset[Any]: ...

    def accepts_end(self, states: frozenset[Any]) -> bool: ...


@dataclass(frozen=True)
class TokenTable:
    """A vocabulary's bytes for a matcher: each text token's bytes (empty for the others: control,
    user-defined and unused tokens, Tokenizer.text_token_bytes), and its first byte (256: none), built
    once per tokenizer (`token_table`)."""

    data: tuple[bytes, ...]
    first: np.ndarray  # (vocab,) int16

    @classmethod
    def build(cls, tokens: TokenSource) -> TokenTable:
        data = tokens.text_token_bytes()
        first = np.fromiter((raw[0] if raw else 256 for raw in data), np.int16, count=len(data))
        return cls(tuple(data), first)


_TABLES: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()


def token_table(tokens: TokenSource) -> TokenTable:
    table = _TABLES.get(tokens)
    if table is None:
        table = _TABLES[tokens] = TokenTable.build(tokens)
    return table


def prompt_opens_thinking(tail: bytes) -> bool:
    """Whether prompt bytes ending in `tail` leave a <think> block open."""
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


class ByteMatcher:
    """One generation's constraint: which tokens may come next (`allows`, `allowed`,
    `first_allowed_window`), and the bytes so far (`feed`). end_ids: the tokens that end the answer
    (allowed only once the recognizer may end). thinking: the prompt leaves a <think> block open.
    literals: special tokens allowed by their text (token id -> bytes)."""

    def __init__(self, recognizer: Recognizer, table: TokenTable, end_ids: Iterable[int], thinking: bool = False,
                 token_bytes: Callable[[int], bytes] | None = None, literals: Mapping[int, bytes] | None = None):
        self.recognizer = recognizer
        self.table = table
        self.end_ids = frozenset(int(t) for t in end_ids)
        self.states = recognizer.initial()
        self.thinking = thinking
        self.literals = dict(literals or {})
        self._tail = b""  # the reasoning's last bytes (to find </think> across tokens)
        self._raw = token_bytes  # a token's own bytes (special ones included: </think> may be one)

    @property
    def complete(self) -> bool:
        return not self.thinking and self.recognizer.accepts_end(self.states)

    def _data(self, token: int) -> bytes:
        return self.table.data[token] or self.literals.get(token, b"")

    def allows(self, token: int) -> bool:
        token = int(token)
        if self.thinking:
            return token not in self.end_ids
        if token in self.end_ids:
            return self.recognizer.accepts_end(self.states)
        data = self._data(token)
        return bool(data) and bool(self.recognizer.advance(self.states, data))

    def allowed(self, ids: Sequence[int] | np.ndarray, limit: int = 0) -> np.ndarray:
        """A boolean mask over ids; limit > 0: stop after that many allowed (the rest left False)."""
        mask = np.zeros(len(ids), bool)
        found = 0
        for i, t in enumerate(np.asarray(ids, np.int64).tolist()):
            if self.allows(t):
                mask[i] = True
                found += 1
                if limit and found >= limit:
                    break
        return mask

    def first_allowed_window(self, order: np.ndarray, window: int, limit: int = 0) -> np.ndarray:
        """The allowed ids of the first run of `window` ranks of `order` (a whole vocabulary's ids, best
        first) that holds one, in rank order (at most `limit` when limit > 0); empty when the format
        allows no token at all. Only tokens whose first byte can come next are checked in full."""
        if self.thinking:
            cand = np.ones(order.size, bool)
        else:
            cand = self._first_bytes()[self.table.first[order]]
            extra = list(self.literals)
            if self.end_ids and self.recognizer.accepts_end(self.states):
                extra += list(self.end_ids)
            if extra:
                cand |= np.isin(order, np.array(extra, np.int64))
        found: list[int] = []
        run = -1
        for p in np.flatnonzero(cand).tolist():
            if run >= 0 and p // window != run:
                break
            t = int(order[p])
            if self.allows(t):
                found.append(t)
                run = p // window
                if limit and len(found) >= limit:
                    break
        return np.array(found, np.int64)

    def _first_bytes(self) -> np.ndarray:
        """(257,) which first bytes can start an allowed token (index 256, no text: False)."""
        out = np.zeros(257, bool)
        for b in range(256):
            out[b] = bool(self.recognizer.advance(self.states, bytes((b,))))
        return out

    def feed(self, token: int) -> None:
        """The sampler drew `token` (an allowed one)."""
        token = int(token)
        if self.thinking:
            raw = self._raw(token) if self._raw is not None else self.table.data[token]
            self._tail = (self._tail + raw)[-64:]
            if THINK_CLOSE in self._tail:
                self.thinking = False
            return
        if token in self.end_ids:
            return
        nxt = self.recognizer.advance(self.states, self._data(token))
        if not nxt:
            raise ValueError(f"token {token} does not continue the constrained answer")
        self.states = nxt


class AnswerFormat(Protocol):
    """What SamplingParams.answer_format holds: a format a generation makes its matcher from (None:
    the format does not apply to this prompt, and the answer runs free)."""

    label: str

    def matcher(self, tokens: TokenSource, end_ids: Iterable[int], prompt_ids: Sequence[int]) -> ByteMatcher | None: ...


def prompt_bytes(tokens: TokenSource, prompt_ids: Sequence[int], last: int = 0) -> bytes:
    """The prompt's bytes (its `last` tokens only when last > 0)."""
    ids = list(prompt_ids)[-last:] if last else list(prompt_ids)
    return b"".join(tokens.token_bytes(int(t)) for t in ids)
