"""Choosing the next token from a row of logits: penalties, temperature, top-k, top-p, min-p, seed.

Runs on the host over one (vocab,) row per step: float32 passes over the vocabulary, float64 for
the probabilities of the tokens that can be drawn. Order of operations (as transformers and
vLLM do it): penalties on the raw logits, then temperature, then the top-k / top-p / min-p filters on
the tempered distribution, then one draw. temperature == 0 means greedy: argmax after the penalties
(lowest id wins a tie), no randomness.

Penalties:
- repetition_penalty (transformers / CTRL style) over every token of the prompt and the output so far:
  a seen token's logit is divided by the penalty when positive, multiplied when negative;
- presence_penalty and frequency_penalty (OpenAI style) over the generated tokens only:
  logit -= presence * [count > 0] + frequency * count.

A decode step may return only the largest logits of its row (TopLogits: the device picks them, so a
token costs a copy of k values instead of the vocabulary): `Sampler.candidates` says how many it asks
for (greedy: 1, top-k: k; with penalties that only lower logits, TOP_CANDIDATES_MAX), and a pick from
them equals the pick from the whole row, token for token under the same seed: both take the k largest
with equal values in ascending id order (`top_logits`), and the draw walks them in that order. With
penalties the candidates decide only when the k-th largest penalized one stays above every logit
outside them (the smallest candidate bounds those, and a penalty never raises one); otherwise the pick
reads the whole row from where the step left it (`TopLogits.whole_row`: still on the device until the
sequence's next step).

A pick from the top logits can also be made by the device, at the end of the step (`PickSpec`: the
kernel pick_top in kernels/sampling.cu does what `draw_from_top` does here, in float64), so that the
step of the next token starts before the host has seen it (Session.launch_next). The uniform number of
each pick is drawn in the same order either way (Sampler.pick_spec looks ahead in the sampler's own
stream), so a seeded generation gives the same tokens whichever side picks. A penalized sampler's
picks are made there too when the sampler knows the vocabulary (`PickSpec.history`): the step first
applies the penalties to its whole row (kernels/sampling.cu penalize, from a table of one int32 a token
that each step updates with the token it embeds), so its top logits are the penalized row's
(`TopLogits.penalized`) and the host draws from them as they are.

What this file is not: the generate loop (generation.py) or stop handling.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .grammar import AnswerFormat, ByteMatcher

log = logging.getLogger(__name__)

# Default lengths when a request gives none. A chat answer may think for a while before it answers
# (Qwen3.5's reasoning often runs past a thousand tokens); a plain-text continuation of a base model
# has no natural end and, past a few paragraphs, mostly repeats itself.
DEFAULT_MAX_TOKENS_CHAT = 2048
DEFAULT_MAX_TOKENS_TEXT = 256
# The most candidates a sampler takes from a step instead of the whole row (top_k above it, or with
# penalties from it: whole rows).
TOP_CANDIDATES_MAX = 64
# The most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound)
TOP_LOGPROBS_MAX = 20


@dataclass(frozen=True)
class TopLogits:
    """The largest logits of T rows as a decode step returns them instead of the rows: values (T, k)
    float32, each row descending, equal values in ascending id order; ids (T, k) their token ids.
    Computed on the device by the top-k kernels (kernels/sampling.cu) or on the host by
    `top_logits`, with the same order. fetch(r) reads row r of the step's whole logits from where the
    step left them (None: not kept); row i here is its row `first + i`; `whole_row` calls it."""

    values: np.ndarray
    ids: np.ndarray
    fetch: Callable[[int], np.ndarray] | None = field(default=None, repr=False, compare=False)
    first: int = 0  # row 0 here is row `first` of what fetch reads
    # (T,) the token the device drew from each row with the PickSpec the step was launched with (the
    # token a chained next step was fed); None: the step was launched without one
    picks: np.ndarray | None = None
    # True: the values are the rows' after the PickSpec's penalties (the device applied them to the whole
    # rows before the top-k; fetch reads the penalized rows); False: the model's own logits
    penalized: bool = False
    # whole rows read through fetch (whole_row), by row; shared with a copy made by dataclasses.replace
    # (Scheduler: the top logits handed to the request with its pick)
    read_rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def row(self, i: int) -> TopLogits:
        """Row i alone, (1, k), copied (a view would keep the whole step's arrays alive)."""
        picks = None if self.picks is None else self.picks[i : i + 1].copy()
        return TopLogits(self.values[i : i + 1].copy(), self.ids[i : i + 1].copy(), self.fetch, self.first + i,
                         picks, self.penalized)

    def whole_row(self, i: int = 0) -> np.ndarray:
        """Row i's whole logits (vocab,) float32, for a pick the top logits do not decide: read (copied)
        through fetch the first time, which must come before the sequence's next step (RuntimeError
        when not kept or stale), then kept with these top logits (the scheduler's draw of a pick and
        the request's own pick read it once). Not to be written to."""
        r = self.first + i
        row = self.read_rows.get(r)
        if row is None:
            if self.fetch is None:
                raise RuntimeError("these top logits were returned without their whole rows")
            row = self.read_rows[r] = np.array(self.fetch(r), np.float32).reshape(-1)
        return row


@dataclass(frozen=True, eq=False)
class PenaltyHistory:
    """What a sampler's penalties apply to, for a device that penalizes a step's whole row before its
    top-k (kernels/sampling.cu penalize): the prompt's ids and the generated ids so far (the sampler's
    own lists, growing as it picks) and the vocabulary's size. The device keeps one int32 a token
    (PROMPT_BIT: in the prompt; the low bits: times generated) that each step updates with the token it
    embeds, which is always the last generated one; the backend rebuilds it from these lists when it is
    not in step with them (a new generation, a step that ran without it)."""

    prompt_ids: Sequence[int]
    generated: Sequence[int]
    vocab: int

    def table(self, counted: int) -> tuple[np.ndarray, np.ndarray]:
        """The device table's non-zero entries once the prompt and the first `counted` generated tokens
        are in it: (token ids int32, values int32), ids in [0, vocab)."""
        n = np.zeros(0, np.int64) if counted <= 0 else np.asarray(self.generated[:counted], np.int64)
        ids, counts = np.unique(n[(n >= 0) & (n < self.vocab)], return_counts=True)
        p = np.unique(np.asarray(self.prompt_ids, np.int64))
        p = p[(p >= 0) & (p < self.vocab)]
        keys = np.union1d(ids, p)
        vals = np.zeros(keys.size, np.int64)
        vals[np.searchsorted(keys, ids)] += counts
        vals[np.searchsorted(keys, p)] |= PROMPT_BIT
        return keys.astype(np.int32), vals.astype(np.int32)


PROMPT_BIT = 1 << 30  # a penalty table's mark of a prompt token (PenaltyHistory; kernels/sampling.cu)


@dataclass(frozen=True)
class PickSpec:
    """How the device draws the next token from a decode step's top logits (kernels/sampling.cu
    pick_top, `draw_from_top` on the host): u the uniform number of this pick, and the sampler's
    temperature (0: the first id, greedy), top_p and min_p, over the first top_k of the step's top
    logits (0: all of them). With `history`, the step first applies the sampler's penalties
    (repetition, presence, frequency) to its whole row on the device (kernels/sampling.cu penalize),
    so that its top logits are the penalized row's (TopLogits.penalized)."""

    u: float
    temperature: float
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    history: PenaltyHistory | None = field(default=None, compare=False, repr=False)

    def as_array(self) -> np.ndarray:
        """The eight float64 values in the order the kernels read them: the pick's five (pick_top), then
        the penalties' three (penalize)."""
        return np.array([self.u, self.temperature, self.top_p, self.min_p, self.top_k, self.repetition,
                         self.presence, self.frequency], np.float64)


GREEDY_PICK = PickSpec(0.0, 0.0)


class LaunchedStep:
    """A decode step's output (host logits, or TopLogits) that may still be computing: the step was
    launched on the device and the host went on with other work (a generate loop hands the previous
    token to its consumer meanwhile; engine/generation.py). result() waits for it the first time and
    returns the same object after that. `LaunchedStep.done(x)`: an output computed already (a backend
    without graphs, an eager step)."""

    def __init__(self, finish: Callable[[], np.ndarray | TopLogits]):
        self._finish: Callable[[], np.ndarray | TopLogits] | None = finish
        self._value: np.ndarray | TopLogits | None = None

    @classmethod
    def done(cls, value: np.ndarray | TopLogits) -> LaunchedStep:
        step = cls(lambda: value)
        step.result()
        return step

    @property
    def waited(self) -> bool:
        """True once the output is on the host (result() returns at once)."""
        return self._finish is None

    def result(self) -> np.ndarray | TopLogits:
        if self._finish is not None:
            finish = self._finish
            self._value = finish()
            self._finish = None
        assert self._value is not None
        return self._value


def log_softmax_at(row: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under a row of the model's own logits (log-softmax, before
    temperature, penalties or a format; float64 sums) and the row's n most likely tokens with theirs
    (descending, ties to the lower id)."""
    x = np.asarray(row, np.float32).reshape(-1)
    top = float(x.max())
    lse = top + math.log(float(np.exp(x - np.float32(top)).sum(dtype=np.float64)))
    alts: list[tuple[int, float]] = []
    if n > 0:
        vals, ids = top_logits(x, n)
        alts = [(int(i), float(v) - lse) for v, i in zip(vals[0].tolist(), ids[0].tolist(), strict=True)]
    return float(x[int(token)]) - lse, alts


def top_logits(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row of logits ((T, V) or (V,)) -> (values (T, k) float32, ids (T, k)
    int64), each row descending, equal values in ascending id order, and of the values equal to the
    k-th largest the lowest ids: the order of the device's top-k (TopLogits)."""
    x = np.asarray(logits, np.float32)
    x = x.reshape(1, -1) if x.ndim == 1 else x
    T, V = x.shape
    k = max(1, min(int(k), V))
    if k == 1:  # greedy: argmax takes the first (lowest-id) maximum
        ids1 = np.argmax(x, axis=1)[:, None]
        return np.take_along_axis(x, ids1, axis=1), ids1.astype(np.int64)
    vals = np.empty((T, k), np.float32)
    ids = np.empty((T, k), np.int64)
    for r in range(T):
        sel = _at_or_above_kth(x[r], k)
        v = x[r, sel]
        order = np.lexsort((sel, -v))[:k]  # descending value, ascending id
        vals[r], ids[r] = v[order], sel[order]
    return vals, ids


_SAMPLE_STRIDE = 16


def _at_or_above_kth(row: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of a row's logits at or above its k-th largest, and maybe a few below it:
    those at or above the k-th largest of every 16th logit, which are k at least (that k-th is at most
    the row's), about 16 k on a row in no particular order, instead of selecting from the whole row
    (1.9 -> 0.2 ms on a 262,144-logit row on the 2-core machine); the whole row's selection when the
    sample is too small or that leaves too many (a sorted row, thousands of ties)."""
    V = row.size
    sample = row[::_SAMPLE_STRIDE]
    if sample.size >= 4 * k:
        t = np.partition(sample, sample.size - k)[sample.size - k]
        sel = np.flatnonzero(row >= t)
        if k <= sel.size <= V // 8:
            return sel
    return np.flatnonzero(row >= np.partition(row, V - k)[V - k])


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow Qwen3.5's non-thinking recommendation."""

    temperature: float = 0.7
    top_k: int = 20  # 0 = off
    top_p: float = 0.8  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # None: the engine's default for the prompt (resolved_max_tokens): a chat answer may think first
    # and gets DEFAULT_MAX_TOKENS_CHAT, a plain-text continuation DEFAULT_MAX_TOKENS_TEXT
    max_tokens: int | None = None
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)  # stop strings (not shown)
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)  # besides the model's EOS
    # the answer's format: JSON of a schema (the API's response_format; engine/json_output.py) or forced
    # tool calls (tool_choice "required" or a named tool; engine/tool_call_grammar.py)
    answer_format: AnswerFormat | None = None
    # each generated token's log-probability and this many of its row's most likely tokens with theirs
    # (0..TOP_LOGPROBS_MAX; None: none): the API's logprobs / top_logprobs
    logprobs: int | None = None
    # (token id, bias) pairs added to the model's logits before the penalties (the API's logit_bias;
    # -100..100, as OpenAI's): a bias of -100 all but bans a token, +100 all but forces it
    logit_bias: tuple[tuple[int, float], ...] = ()
    # each prompt token's log-probability given the ones before it, with this many alternatives (None:
    # none; the API's echo): the prompt then runs from an empty history with every row's logits
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # NaN passes every comparison below and inf turns the distribution into NaNs: refuse both
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed} (leave it out for a random seed)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min_p must be in [0, 1)")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0 (1 = off)")
        self.logit_bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        for t, b in self.logit_bias:
            if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got {t}: {b}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= TOP_LOGPROBS_MAX:
                raise ValueError(f"{name} must be an integer in [0, {TOP_LOGPROBS_MAX}]")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_max_tokens(self, templated: bool) -> int:
        """max_tokens, or the default for a chat answer (templated) or a plain-text continuation."""
        if self.max_tokens is not None:
            return self.max_tokens
        return DEFAULT_MAX_TOKENS_CHAT if templated else DEFAULT_MAX_TOKENS_TEXT

    def with_max_tokens(self, templated: bool) -> SamplingParams:
        """A copy whose max_tokens is resolved (see resolved_max_tokens)."""
        return replace(self, max_tokens=self.resolved_max_tokens(templated))


def greedy_params(**overrides: Any) -> SamplingParams:
    """Deterministic argmax decoding (tests, benchmarks)."""
    return SamplingParams(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, **overrides})


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int] = (),
                    generated_ids: Sequence[int] = ()) -> np.ndarray:
    """A float32 copy of `logits` with the penalties applied (computed in float64 on the few
    penalized entries)."""
    view = PenaltyView(prompt_ids)
    view.add(generated_ids)
    return _penalized(logits, None, _penalties_of(params), view)


class PenaltyView:
    """What the penalties read of a prompt and the tokens generated after it, extended token by token
    (not rebuilt from the whole history at every pick): the ids seen in either (the repetition
    penalty's) and how often each id was generated (the presence and frequency penalties')."""

    def __init__(self, prompt_ids: Sequence[int] = ()):
        self.seen: set[int] = {int(t) for t in prompt_ids}
        self.counts: Counter[int] = Counter()
        self.tokens = 0  # generated tokens added

    def add(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.seen.add(int(t))
            self.counts[int(t)] += 1
        self.tokens += len(tokens)


Penalties = tuple[float, float, float]  # (repetition, presence, frequency)


def _penalties_of(params: SamplingParams) -> Penalties:
    return float(params.repetition_penalty), float(params.presence_penalty), float(params.frequency_penalty)


def _penalized(values: np.ndarray, ids: np.ndarray | None, penalties: Penalties, view: PenaltyView) -> np.ndarray:
    """A float32 copy of `values`, the logits of token ids `ids` (None: a whole row, ids 0..V-1), with
    the penalties applied: float64 arithmetic on each penalized entry, the same whichever way it is
    given, so a candidate's penalized value equals its value in the penalized row."""
    repetition, presence, frequency = penalties
    out = np.array(values, dtype=np.float32).reshape(-1)
    seen, counts = view.seen, view.counts
    if repetition != 1.0 and seen:
        if ids is None:
            at = np.fromiter(seen, dtype=np.int64, count=len(seen))
        else:
            at = np.flatnonzero(np.fromiter((int(i) in seen for i in ids), dtype=bool, count=len(ids)))
        if at.size:
            vals = out[at].astype(np.float64)
            out[at] = np.where(vals > 0, vals / repetition, vals * repetition)
    if (presence or frequency) and counts:
        if ids is None:
            at = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            n = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        else:
            n = np.array([counts.get(int(i), 0) for i in ids], np.float64)
            at = np.flatnonzero(n)
            n = n[at]
        out[at] = out[at].astype(np.float64) - (presence + frequency * n)
    return out


def _candidates(values: np.ndarray, ids: np.ndarray, k: int, params: SamplingParams | PickSpec,
                penalties: Penalties = (1.0, 0.0, 0.0),
                view: PenaltyView | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's candidates (its largest logits, descending with equal values in ascending id order, as
    top_logits gives them; their ids) -> the k largest once _penalized applies over `view` (float64
    values, int64 ids), then what a draw with `params` keeps of those k (kept_tokens: the kept ids and
    their float64 probabilities; the first id when greedy). A set intersection finds the candidates the
    penalties touch; the arithmetic is _candidate_loop's."""
    # contiguous float64 / int64, the one signature the loop is compiled for (_compiled_candidate_loop)
    values, ids = np.ascontiguousarray(values, np.float64), np.ascontiguousarray(ids, np.int64)
    seen_at, count_at = _UNMARKED
    if view is not None:
        repetition, presence, frequency = penalties
        listed = ids.tolist()
        hit_rep = view.seen.intersection(listed) if repetition != 1.0 and view.seen else set()
        hit_pf = view.counts.keys() & listed if (presence or frequency) and view.counts else set()
        if hit_rep or hit_pf:
            seen_at = np.zeros(len(listed), np.bool_)
            seen_at[[listed.index(t) for t in hit_rep]] = True  # a row's ids are distinct
            count_at = np.zeros(len(listed), np.int64)
            for t in hit_pf:
                count_at[listed.index(t)] = view.counts[t]
    return _compiled_candidate_loop()(values, ids, k, seen_at, count_at, *penalties, float(params.temperature),
                                      float(params.top_p), float(params.min_p))


_UNMARKED = np.zeros(0, np.bool_), np.zeros(0, np.int64)  # no candidate penalized


def _candidate_loop(values: np.ndarray, ids: np.ndarray, k: int, seen_at: np.ndarray, count_at: np.ndarray,
                    repetition: float, presence: float, frequency: float, temperature: float, top_p: float,
                    min_p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """_candidates' arithmetic, compiled by _compiled_candidate_loop. Each marked candidate's logit is
    penalized in float64 and rounded to float32 after each penalty, as _penalized stores it, and moved
    into its place (the candidates come in order, so only the penalized move). Then the k largest are
    tempered and filtered as _filtered does: top-p over them in descending probability (exp may round
    two logits to one probability, whose ids then come in either order), min-p, renormalized."""

    def settle(a: np.ndarray, o: np.ndarray, i: int) -> None:
        # a[i] (its id o[i]) back into place among a[:i]: descending, equal values by ascending id
        x, t = a[i], o[i]
        j = i
        while j > 0 and (a[j - 1] < x or (a[j - 1] == x and o[j - 1] > t)):
            a[j] = a[j - 1]
            o[j] = o[j - 1]
            j -= 1
        a[j] = x
        o[j] = t

    v, o = values, ids
    if seen_at.size:
        v, o = values.copy(), ids.copy()
        for i in range(v.size):
            if seen_at[i]:
                v[i] = np.float64(np.float32(v[i] / repetition if v[i] > 0 else v[i] * repetition))
            if count_at[i]:
                v[i] = np.float64(np.float32(v[i] - (presence + frequency * count_at[i])))
            settle(v, o, i)
    best, best_ids = v[:k], o[:k]
    n = best.size
    p = np.ones(n)
    kept = best_ids.copy()
    if temperature <= 0:
        return best, best_ids, kept[:1], p[:1]
    total = 0.0
    for i in range(n):
        p[i] = math.exp((best[i] - best[0]) / temperature)
        total += p[i]
    for i in range(n):
        p[i] = p[i] / total
    n_keep = n
    if top_p < 1.0:
        for i in range(1, n):
            settle(p, kept, i)
        cum = 0.0  # the smallest prefix whose mass reaches top_p (the token that crosses it included)
        for i in range(n):
            cum += p[i]
            if cum >= top_p:
                n_keep = i + 1
                break
    floor = min_p * p[:n_keep].max() if min_p > 0.0 else 0.0
    m = 0
    for i in range(n_keep):  # the min-p filter, in place
        if p[i] >= floor:
            p[m] = p[i]
            kept[m] = kept[i]
            m += 1
    total = 0.0
    for i in range(m):
        total += p[i]
    for i in range(m):
        p[i] = p[i] / total
    return best, best_ids, kept[:m], p[:m]


@functools.cache
def _compiled_candidate_loop() -> Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """_candidate_loop compiled by numba (cached on disk) the first time a pick needs it: a step's picks
    are drawn one after another between two steps (engine/scheduler.py), where the same loops in the
    interpreter took most of 30 us a pick. It keeps the interpreter while it runs (a few
    microseconds): released, a busy thread could take it and hold the scheduler's thread up to a
    switch interval (5 ms) between two picks. It is compiled here, on arguments of the types every
    pick passes; without numba, or with one that cannot compile it, the loop runs as written (the same
    arithmetic, slower), with a warning in the log for the second."""
    try:
        from numba import njit
    except ImportError:
        return _candidate_loop
    try:
        compiled = njit(cache=True)(_candidate_loop)
        ids = np.arange(2, dtype=np.int64)
        compiled(np.array([1.0, 0.5]), ids, 1, np.ones(2, np.bool_), np.ones(2, np.int64), 1.1, 0.1, 0.1,
                 1.0, 0.9, 0.05)  # every pick's one signature (_candidates)
    except Exception as exc:  # noqa: BLE001 - any failure of the compiler leaves the loop as written
        log.warning("the pick's candidate loop runs uncompiled: numba failed to compile it (%s)", exc)
        return _candidate_loop
    return compiled


def kept_tokens(logits: np.ndarray, params: SamplingParams | PickSpec) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities) a draw chooses from: softmax(logits / T) restricted by top-k, top-p and
    min-p, renormalized to sum to 1 (float64).

    Cost matters here (one call per generated token over a 248k vocabulary): whole-vocabulary passes
    are float32 (selection, and the softmax denominator with float64 accumulation); the kept tokens'
    probabilities are float64. Without top-k, top-p is found among the most probable tokens only (the
    1024 largest logits and every tie at the 1024th, widened until they hold the top-p mass). Ties go
    to the lower id.
    """
    x = np.asarray(logits, np.float32).reshape(-1)
    t = float(params.temperature)
    n = x.size
    if params.top_k and params.top_k < n:
        vals, ids = top_logits(x, params.top_k)
        return _kept_of_top(vals[0], ids[0], params)
    top = float(x.max())
    e = np.exp((x - np.float32(top)) / np.float32(t))  # float32 pass over the vocabulary
    total = e.sum(dtype=np.float64)
    if params.top_p < 1.0:
        m = min(n, 1024)
        while True:
            ids = _at_or_above_kth(x, m) if m < n else np.arange(n)  # the m largest and every tie at the m-th
            if m == n or e[ids].sum(dtype=np.float64) >= params.top_p * total:
                break
            m = min(n, m * 8)
        w = np.exp((x[ids].astype(np.float64) - top) / t)
    else:
        ids = np.arange(n)
        w = e.astype(np.float64)
    return _filtered(ids, w / total, params)


def compile_candidate_loop() -> None:
    """Compile the loop of a pick from a step's candidates now (or load it from numba's disk cache:
    about 2 s the first time, 0.15 s after), not inside a first token."""
    _compiled_candidate_loop()


def _kept_of_top(values: np.ndarray, ids: np.ndarray,
                 params: SamplingParams | PickSpec) -> tuple[np.ndarray, np.ndarray]:
    """kept_tokens when top-k decides first, from the k largest logits (descending, ties by id) and
    their ids: the kept ids (int64) and their probabilities (float64, summing to 1). The filters after
    top-k see its renormalized distribution."""
    _, _, kept, p = _candidates(values, ids, len(values), params)
    return kept, p


def _filtered(ids: np.ndarray, p: np.ndarray, params: SamplingParams | PickSpec) -> tuple[np.ndarray, np.ndarray]:
    """The top-p and min-p filters over candidate ids with probabilities p, renormalized."""
    if params.top_p < 1.0:
        order = np.lexsort((ids, -p))  # descending probability, lower id first on ties
        ids, p = ids[order], p[order]
        # the smallest prefix whose mass reaches top_p (the token that crosses it included)
        n_keep = min(len(p), int(np.searchsorted(np.cumsum(p), params.top_p, side="left")) + 1)
        ids, p = ids[:n_keep], p[:n_keep]
    if params.min_p > 0.0:
        keep = p >= params.min_p * p.max()
        ids, p = ids[keep], p[keep]
    return ids, p / p.sum()


def draw_from_top(values: np.ndarray, ids: np.ndarray, spec: PickSpec) -> int:
    """The token a pick with `spec` draws from one row's k largest logits (descending, equal values in
    ascending id order) and their ids: the first id when greedy, else the inverse CDF at spec.u over
    the tempered, top-p and min-p filtered distribution of the k (float64). What the device's pick_top
    computes (kernels/sampling.cu), and the host's pick from top logits. A spec's top_k > 0 takes the
    first top_k of them."""
    if spec.top_k > 0:
        values, ids = values[: spec.top_k], ids[: spec.top_k]
    if spec.temperature <= 0:
        return int(ids[0])
    return _draw_kept(*_kept_of_top(values, ids, spec), spec.u)


def _draw_kept(ids: Sequence[int] | np.ndarray, p: Sequence[float] | np.ndarray, u: float) -> int:
    """The inverse CDF at u over kept token ids with probabilities p (summing to 1): the first id whose
    running sum of p exceeds u (the last one if none does)."""
    cum = 0.0
    for i, x in enumerate(p.tolist() if isinstance(p, np.ndarray) else p):
        cum += x
        if cum > u:
            return int(ids[i])
    return int(ids[len(ids) - 1])


def _pick_row(x: np.ndarray, sel: SamplingParams | PickSpec, u: float) -> int:
    """The token a pick with `sel`'s temperature and filters draws at uniform number u from a whole row
    of (penalized) logits: argmax when greedy (lowest id on a tie), else the inverse CDF over the kept
    tokens (over the tempered exponentials of the whole row when no filter applies)."""
    if sel.temperature <= 0:
        return int(np.argmax(x))
    if not (sel.top_k and sel.top_k < x.size) and sel.top_p >= 1.0 and sel.min_p <= 0.0:
        return _inverse_cdf(np.exp((x - x.max()) / np.float32(sel.temperature)), u)
    return _draw_kept(*kept_tokens(x, sel), u)


_FEW = 4096  # logits sorted outright (np.lexsort) rather than selected from a whole row (top_logits)


def _lowering(penalties: Penalties) -> bool:
    """Whether penalties can only lower a logit (repetition >= 1, presence and frequency >= 0)."""
    repetition, presence, frequency = penalties
    return repetition >= 1.0 and presence >= 0 and frequency >= 0


def pick_penalized(top: TopLogits, spec: PickSpec, view: PenaltyView, candidates: int) -> int:
    """The token a penalized pick (spec: its u, filters and penalties; its top_k the k of the sampler,
    1 when greedy) draws from a row's unpenalized largest logits, the first `candidates` of them, with
    the penalties over `view`: from the k largest penalized candidates when they decide (the k-th stays
    above the smallest candidate, which bounds every logit outside them), else from the whole row,
    read through top.whole_row(). The same token either way (module docstring)."""
    vals, ids = top.values[0, :candidates], top.ids[0, :candidates]
    penalties = (spec.repetition, spec.presence, spec.frequency)
    k = max(1, spec.top_k)
    best, best_ids, kept, p = _candidates(vals, ids, k, spec, penalties, view)
    if not best[-1] > vals[-1]:  # the whole row's k largest penalized, as kept_tokens takes them
        x = _penalized(top.whole_row(), None, penalties, view)
        # each is at or above the candidates' k-th penalized when the penalties only lower logits (the
        # candidates give k at that level): the few there are sorted instead of the whole row selected
        at = np.flatnonzero(x >= best[-1]) if _lowering(penalties) else None
        if at is not None and at.size <= _FEW:
            order = np.lexsort((at, -x[at]))[:k]  # descending, lower id first on ties
            best, best_ids = x[at[order]], at[order]
        else:
            top_vals, top_ids = top_logits(x, k)
            best, best_ids = top_vals[0], top_ids[0]
        kept, p = _kept_of_top(best, best_ids, spec)
    return int(best_ids[0]) if spec.temperature <= 0 else _draw_kept(kept, p, spec.u)


def _could_draw(values: np.ndarray, ids: np.ndarray, spec: PickSpec, token: int, eps: float = 1e-9) -> bool:
    """Whether `token` is what draw_from_top gives for a spec within eps of `spec` (u, top_p, min_p): a
    pick the device's float64 arithmetic, summed in another order, may make where u or a filter's
    threshold lies within rounding of a boundary."""
    for du in (-eps, eps):
        for dp in (-eps, eps):
            for dm in (-eps, eps):
                near = replace(spec, u=spec.u + du, top_p=min(1.0, spec.top_p + dp), min_p=max(0.0, spec.min_p + dm))
                if draw_from_top(values, ids, near) == token:
                    return True
    return False


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """kept_tokens as a full (vocab,) float64 distribution (zeros outside the kept set)."""
    ids, p = kept_tokens(logits, params)
    out = np.zeros(np.asarray(logits).size, np.float64)
    out[ids] = p
    return out


def _inverse_cdf(weights: np.ndarray, u: float, block: int = 1024) -> int:
    """The index i with cdf[i-1] <= u * total < cdf[i] for non-negative weights, without a cumulative
    sum over the whole vocabulary (a prefix sum is sequential; block sums are not): find the block
    first, then the index inside it. float64 sums."""
    n = weights.size
    n_full = n - n % block
    sums = weights[:n_full].reshape(-1, block).sum(axis=1, dtype=np.float64)
    if n_full < n:
        sums = np.append(sums, weights[n_full:].sum(dtype=np.float64))
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    inner = np.cumsum(weights[b * block : (b + 1) * block], dtype=np.float64)
    i = int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0), side="right"))
    return b * block + min(i, len(inner) - 1)


class Sampler:
    """Stateful sampler for one generation: remembers the prompt, the output so far and the RNG.
    vocab > 0 (the model's vocabulary size): a device may apply this sampler's penalties itself
    (PickSpec.history), so that a penalized sampler's picks chain too."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), vocab: int = 0,
                 grammar: ByteMatcher | None = None):
        self.params = params
        # the tokens this generation may draw next (params.answer_format's matcher): see _pick_allowed
        self.grammar = grammar
        self.prompt_ids = list(prompt_ids)
        self.generated: list[int] = []
        self.rng = np.random.default_rng(params.seed)
        self._ahead: deque[float] = deque()  # uniform numbers drawn for picks to come (pick_spec)
        self._history = PenaltyHistory(self.prompt_ids, self.generated, vocab) if vocab > 0 else None
        self._view: PenaltyView | None = None  # the penalties' view of prompt_ids + generated

    def __call__(self, logits: np.ndarray | TopLogits) -> int:
        """Pick the next token from a (vocab,) row, or from its largest logits (at least `candidates`
        of them), and remember it."""
        token = self.pick(logits)
        self.generated.append(token)
        if self.grammar is not None:
            self.grammar.feed(token)
        return token

    @property
    def penalized(self) -> bool:
        prm = self.params
        return prm.repetition_penalty != 1.0 or bool(prm.presence_penalty) or bool(prm.frequency_penalty)

    @property
    def chains(self) -> bool:
        """True when the device can make this sampler's picks itself from a step's top logits and feed
        each to the next step (Session.launch_next): greedy or a top-k of at most TOP_CANDIDATES_MAX,
        and no penalties or penalties the device applies (a vocabulary given, and top logits that serve
        a host pick too when a step runs without them: candidates)."""
        prm = self.params
        if self.grammar is not None or prm.logprobs is not None or prm.logit_bias:
            return False  # the host decides which tokens may come, or reads every row
        if self.penalized and (self._history is None or self.candidates == 0):
            return False
        return prm.greedy or 0 < prm.top_k <= TOP_CANDIDATES_MAX

    def pick_spec(self, ahead: int = 0) -> PickSpec | None:
        """How the device makes the pick `ahead` picks from now (0: the next one) when this sampler
        chains, else None: its uniform number is drawn now from the sampler's stream, and that pick
        (on the host or from the device) uses that number."""
        if not self.chains:
            return None
        if self.params.greedy:
            return self._spec(0.0)
        while len(self._ahead) <= ahead:
            self._ahead.append(float(self.rng.random()))
        return self._spec(self._ahead[ahead])

    def _spec(self, u: float) -> PickSpec:
        """The PickSpec of a pick at uniform number u (unused when greedy): the sampler's temperature and
        filters and, when it is penalized, its penalties and history, over the first k of a step's
        candidates (k = 1 when greedy)."""
        prm = self.params
        spec = GREEDY_PICK if prm.greedy else PickSpec(u, float(prm.temperature), float(prm.top_p), float(prm.min_p))
        if not self.penalized:
            return spec
        return replace(spec, top_k=1 if prm.greedy else prm.top_k, repetition=float(prm.repetition_penalty),
                       presence=float(prm.presence_penalty), frequency=float(prm.frequency_penalty),
                       history=self._history)

    def _penalty_view(self) -> PenaltyView:
        """The penalties' view of the prompt and `generated`, extended with the tokens generated since
        the last pick (made again if `generated` shrank)."""
        view, gen = self._view, self.generated
        if view is None or view.tokens > len(gen):
            view = self._view = PenaltyView(self.prompt_ids)
        view.add(gen[view.tokens :])
        return view

    def _uniform(self) -> float:
        """The next pick's uniform number: one a step, in order, reproducible for a seed."""
        return self._ahead.popleft() if self._ahead else float(self.rng.random())

    @property
    def candidates(self) -> int:
        """How many of a row's largest logits this sampler asks a step for (TopLogits), or 0 when it
        needs the whole row: greedy 1, top-k k (up to TOP_CANDIDATES_MAX); with penalties that only
        lower logits (repetition >= 1, presence and frequency >= 0) and k below TOP_CANDIDATES_MAX,
        TOP_CANDIDATES_MAX, of which the pick checks that they decide it (module docstring); other
        penalties and top-k off: 0."""
        prm = self.params
        if prm.logprobs is not None or prm.logit_bias:  # a token's log-probability, a bias: whole rows
            return 0
        if self.grammar is not None:  # the largest TOP_CANDIDATES_MAX, penalized on the host: whole rows
            return 0 if self.penalized else TOP_CANDIDATES_MAX
        k = 1 if prm.greedy else prm.top_k
        if not 0 < k <= TOP_CANDIDATES_MAX:
            return 0
        if not self.penalized:
            return k
        # (k = TOP_CANDIDATES_MAX would leave no candidate below the k-th to bound the rest: whole rows)
        return TOP_CANDIDATES_MAX if _lowering(_penalties_of(prm)) and k < TOP_CANDIDATES_MAX else 0

    def pick(self, logits: np.ndarray | TopLogits) -> int:
        if self.grammar is not None:
            return self._pick_allowed(logits, self.grammar)
        if isinstance(logits, TopLogits):
            return self._pick_top(logits)
        return _pick_row(self._adjusted(logits), self.params, 0.0 if self.params.greedy else self._uniform())

    def _adjusted(self, row: np.ndarray) -> np.ndarray:
        """A whole row as the pick sees it: a float32 copy plus the logit bias, then the penalties."""
        x = np.array(row, np.float32).reshape(-1)
        if self.params.logit_bias:
            ids = np.array([t for t, _ in self.params.logit_bias], np.int64)
            bias = np.array([b for _, b in self.params.logit_bias], np.float32)
            inside = ids < x.size
            x[ids[inside]] += bias[inside]
        return _penalized(x, None, _penalties_of(self.params), self._penalty_view())

    def _pick_allowed(self, logits: np.ndarray | TopLogits, grammar: ByteMatcher) -> int:
        """A pick under a grammar: the sampler's filters over the allowed tokens among the row's
        TOP_CANDIDATES_MAX largest (penalized) logits, or, when none of those is allowed, among the next
        TOP_CANDIDATES_MAX in rank order that hold one, and so on (descending, ties by id): the
        distribution of the allowed tokens, cut where the row's own ranking leaves them no weight to
        speak of, without checking the whole vocabulary each token. Greedy: the largest allowed."""
        prm = self.params
        limit = 1 if prm.greedy else max(0, prm.top_k)
        if isinstance(logits, TopLogits) and not self.penalized and not prm.logit_bias:
            vals, ids = logits.values[0], np.asarray(logits.ids[0], np.int64)
            mask = grammar.allowed(ids, limit)
            if mask.any():
                return self._draw_allowed(vals[mask], ids[mask])
            row = logits.whole_row()
        else:
            row = logits.whole_row() if isinstance(logits, TopLogits) else np.asarray(logits).reshape(-1)
        x = self._adjusted(row)
        order = np.argsort(-x, kind="stable")  # descending, lower id first on ties
        ids = grammar.first_allowed_window(order, TOP_CANDIDATES_MAX, limit)
        if ids.size == 0:
            raise RuntimeError("the answer's format allows no token of the vocabulary here")
        return self._draw_allowed(x[ids], ids)

    def _draw_allowed(self, vals: np.ndarray, ids: np.ndarray) -> int:
        """The pick from allowed candidates (descending, ties by id): greedy the first, else the
        sampler's temperature, top-k, top-p and min-p over them (draw_from_top)."""
        prm = self.params
        if prm.greedy:
            return int(ids[0])
        spec = PickSpec(self._uniform(), float(prm.temperature), float(prm.top_p), float(prm.min_p),
                        top_k=max(0, prm.top_k))
        return draw_from_top(vals, ids, spec)

    def _pick_top(self, top: TopLogits) -> int:
        """pick from a row's largest logits: the same token as from the whole row (module docstring)."""
        prm = self.params
        k = 1 if prm.greedy else prm.top_k
        want = self.candidates
        if want == 0 or top.values.ndim != 2 or top.values.shape[0] != 1 or top.values.shape[1] < want:
            raise ValueError(f"a pick with these sampling settings needs {want or 'the whole row of'} logits, "
                             f"got the largest {top.values.shape}")
        if self.penalized and not top.penalized:  # penalized here, from the candidates or the whole row
            return pick_penalized(top, self._spec(0.0 if prm.greedy else self._uniform()), self._penalty_view(), want)
        vals, ids = top.values[0, :want], np.asarray(top.ids[0, :want], np.int64)
        spec = GREEDY_PICK if prm.greedy else PickSpec(self._uniform(), prm.temperature, prm.top_p, prm.min_p)
        token = draw_from_top(vals[:k], ids[:k], spec)
        if top.picks is not None:
            # the device drew this row's token with the same spec (it fed it to a next step already):
            # where rounding decides between two tokens, its token is the one the history holds
            dev = int(top.picks[0])
            if dev != token and _could_draw(vals[:k], ids[:k], spec, dev):
                return dev
        return token
