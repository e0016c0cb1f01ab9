"""Session: the state of one sequence (one chat) on a loaded Model, so later turns only pay for new tokens.

A session holds, per layer, the LayerState its model module made (attention KV cache, Gated DeltaNet
conv + recurrent state), the token history, and the next position. `prefill` and `step` append tokens;
`sync(ids)` makes the history equal to `ids` at the lowest cost and returns the last logits (the
generate loop uses it, so regenerate and edit-and-resend only compute the changed suffix).

Rewinding. Attention caches can be truncated to any length. Recurrent (GDN) state cannot be rewound:
it summarizes every token seen. So the session keeps *snapshots*: host copies of the recurrent arrays
plus the KV lengths (not the KV contents) and the last logits, taken at turn boundaries (after each
prompt and after each generation; see `checkpoint`). To go back to n tokens, the session restores the
latest snapshot at or before n whose tokens are still a prefix of the history (so the KV prefix it refers
to is intact), then prefills the remaining known tokens up to n. With no usable snapshot it starts from
zero state and prefills `tokens[:n]` again: truncation always works, its cost depends on the snapshots.
Models without recurrent layers (Gemma 3) truncate their caches directly.

The context limit. A sequence holds at most `context_limit(model)` tokens: the loaded model's planned
context (Placement.context, the context its memory estimate was made for: the app's layer map, the
CLI's --context), capped at the trained context; the trained context when the model was loaded without
a plan. A session's KV caches are allocated for the whole limit when it is made (`initial_capacity`),
so the plan's memory is what it holds from the first token; a session never runs past its limit
(ContextFullError, before any token of the run is computed).

Images. Rows given as embeddings (`embed_override`, with (3, T) M-RoPE positions) enter the history as
negative keys derived from their values, so only the same image counts as a common prefix; the rows'
values and every token's (t, h, w) position are kept, so a truncate can re-prefill them exactly.

What this file is not: sampling or text handling (generation.py), or a scheduler for many sequences.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .backends.base import LayerState
from .errors import ContextFullError, GenerationCancelled
from .execution import shift_override
from .placement import Placement
from .sampling import LaunchedStep, PickSpec, TopLogits

# The id a chained step's token holds in Session.tokens until the step before it is waited for
# (Session.launch_next); never a token id or an image row's key (those are >= 0, or a crc32 below -1).
_PICK_PENDING = -(1 << 40)

# Turn boundaries kept per session: enough for "regenerate" (after the prompt) and "edit the last
# message" (end of the previous turn). Each holds the recurrent state on the host: ~50 MiB for 9B,
# ~150 MiB for 27B, so a runtime with several sessions must not keep many.
MAX_SNAPSHOTS = 3
# Tokens per prefill run. Every prefill is chunked, whoever calls it: a chunk bounds the memory of one
# run (activations grow with its length) and the latency of a cancel (checked between chunks).
PREFILL_CHUNK = 512
SCORE_CHUNK = 64  # positions whose whole logit rows one step of Session.score brings to the host
# KV rows a session of a model loaded without a plan (load_model(backend=...): tests, benchmarks)
# allocates at first; its caches grow by doubling up to the context limit.
DEFAULT_CAPACITY = 8192


class _ContextConfig(Protocol):
    @property
    def context_length(self) -> int: ...  # trained context (0 = unknown)


class PlannedModel(Protocol):
    """What the context limit is read from (engine.model.Model, the scheduler's view of it, and the
    runtime's models all have these)."""

    @property
    def config(self) -> _ContextConfig: ...

    @property
    def placement(self) -> object: ...  # a Placement, a part -> device mapping, or None


def context_limit(model: PlannedModel) -> int:
    """The most tokens one sequence of `model` may hold, prompt and answer together: the planned
    context (the Placement it was loaded with: its memory estimate assumed this many tokens), capped
    at the trained context; without a plan the trained context, or DEFAULT_CAPACITY when the file
    does not say. Always >= 1."""
    trained = int(model.config.context_length or 0)
    placement = model.placement
    if isinstance(placement, Placement):
        return min(placement.context, trained) if trained else placement.context
    return trained or DEFAULT_CAPACITY


def initial_capacity(model: PlannedModel) -> int:
    """KV rows a new session allocates: the whole context limit when the model has a plan (so the
    caches never grow: the plan's memory is taken up front); without one at most DEFAULT_CAPACITY."""
    limit = context_limit(model)
    return limit if isinstance(model.placement, Placement) else min(limit, DEFAULT_CAPACITY)


def context_full(n_tokens: int, limit: int, trained: int) -> ContextFullError:
    """The error for a sequence of `n_tokens` on a model that holds `limit` (trained for `trained`)."""
    if trained and limit >= trained:
        what = "the context length it was trained for"
        how = "shorten the prompt or the conversation, or start a new chat"
    else:
        what = "the context length it was loaded with"
        most = f", up to {trained:,} (its trained context)" if trained else ""
        how = ("shorten the prompt or the conversation, start a new chat, or load the model with a "
               "longer context (--context N for minecart run, chat and serve; the context field on "
               f"the app's Layers page){most}")
    return ContextFullError(f"the prompt and its answer need {n_tokens:,} tokens, but the loaded model "
                            f"holds at most {limit:,} ({what}): {how}",
                            needed=n_tokens, limit=limit, trained=trained)


@dataclass(frozen=True)
class Snapshot:
    """A point in a session's history. Host copies of the recurrent arrays; KV by length only."""

    tokens: tuple[int, ...]  # history keys (token ids; negative keys for image rows)
    next_positions: tuple[int, ...]  # next position after each token (positions can jump after images)
    positions: tuple[tuple[int, int, int], ...]  # (t, h, w) position of each token
    recurrent: tuple[dict, ...]  # per layer: {name: host array}
    kv_lengths: tuple[int | None, ...]
    last_logits: np.ndarray | None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class Session:
    """One sequence's state on `model`. Not thread-safe: use it from the thread that owns the model."""

    def __init__(self, model, capacity: int | None = None, kv_type: str | None = None):
        """capacity: KV rows to allocate (default: initial_capacity(model), the whole context limit
        of a planned model). A capacity beyond the model's limit raises this session's limit to it
        (a benchmark at a long context); the session never holds more than `limit` tokens."""
        self.model = model
        self.capacity = capacity
        # kv_type: None = the model's (load_model(kv_type=)); one of engine/kvquant.py's KV_TYPES
        states = model.new_state(capacity, kv_type=kv_type) if kv_type else model.new_state(capacity)
        self.states: list[LayerState] = states
        self.tokens: list[int] = []
        self._next_positions: list[int] = []
        self._positions: list[tuple[int, int, int]] = []  # (t, h, w) of each token, for re-prefill
        self.last_logits: np.ndarray | None = None  # (vocab,) after the last token of `tokens`
        self.snapshots: list[Snapshot] = []
        self.computed_tokens = 0  # tokens run through the model by the last sync/prefill (stats)
        self._row_values: dict[int, np.ndarray] = {}  # history key -> embedding row (images)
        self.max_snapshots = MAX_SNAPSHOTS
        self._launched: list[LaunchedStep] = []  # launched steps whose results were not taken, in order

    # ---- basic properties ----------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def limit(self) -> int:
        """The most tokens this session may hold: the model's context limit (read now, so it follows
        the model's plan), or the session's capacity when that was asked larger."""
        return max(int(self.capacity or 0), context_limit(self.model))

    @property
    def position(self) -> int:
        """The position the next token gets."""
        return self._next_positions[-1] if self._next_positions else 0

    @property
    def has_recurrent_state(self) -> bool:
        return any(st.recurrent for st in self.states)

    def _layer_backend(self, i: int):
        return self.model.backend_of(f"layer.{i}")

    def _keys(self, ids, embed_override) -> list[int]:
        """History entries for `ids`: the token id, or for a row given as an embedding a negative key
        from its values (so two different images with the same placeholder ids never count as a
        common prefix). The values are kept so that truncate can re-prefill such rows."""
        keys = [int(t) for t in ids]
        if embed_override is not None:
            for r, vec in zip(np.asarray(embed_override[0]).reshape(-1),
                              np.asarray(embed_override[1], dtype=np.float32), strict=True):
                key = -1 - zlib.crc32(vec.tobytes())
                keys[int(r)] = key
                self._row_values[key] = vec.copy()
        return keys

    def _ids_and_override(self, keys):
        """Inverse of _keys for re-prefilling known history: (ids, embed_override or None)."""
        ids = [k if k >= 0 else 0 for k in keys]  # row 0's embedding is replaced anyway
        rows = [i for i, k in enumerate(keys) if k < 0]
        if not rows:
            return ids, None
        return ids, (np.array(rows), np.stack([self._row_values[keys[i]] for i in rows]))

    # ---- running tokens ----------------------------------------------------------------------------
    def _new_positions(self, T: int, positions) -> tuple[np.ndarray, list[int], list[tuple[int, int, int]]]:
        """For T new tokens: their positions ((T,), or the given (3, T) M-RoPE ones), the position
        that follows each, and each one's (t, h, w)."""
        if len(self.tokens) + T > self.limit:
            raise context_full(len(self.tokens) + T, self.limit, int(self.model.config.context_length or 0))
        if positions is None:  # text: each position (t, h, w) = (p, p, p)
            start = self.position
            return np.arange(start, start + T), list(range(start + 1, start + T + 1)), \
                [(p, p, p) for p in range(start, start + T)]
        positions = np.asarray(positions)
        flat = positions if positions.ndim == 1 else positions.max(axis=0)
        next_pos = [int(p) + 1 for p in np.maximum.accumulate(np.maximum(flat, self.position - 1))]
        pos3 = np.broadcast_to(positions, (3, T)) if positions.ndim == 1 else positions
        return positions, next_pos, [(int(col[0]), int(col[1]), int(col[2])) for col in pos3.T]

    def _advance(self, ids: list[int], positions=None, rows: str | None = "last", embed_override=None,
                 chunk: int | None = None, cancel=None, top: int = 0):
        self._settle()
        T = len(ids)
        positions, next_pos, pos3 = self._new_positions(T, positions)
        keys = self._keys(ids, embed_override)
        try:
            logits = self.model.forward(ids, self.states, positions, rows=rows, chunk=chunk,
                                        cancel=cancel, embed_override=embed_override, top=top)
        except GenerationCancelled as exc:  # between chunks: the chunks that went through stay
            done = exc.tokens_done
            self.tokens.extend(keys[:done])
            self._next_positions.extend(next_pos[:done])
            self._positions.extend(pos3[:done])
            self.computed_tokens += done
            self.last_logits = None
            raise
        self.tokens.extend(keys)
        self._next_positions.extend(next_pos)
        self._positions.extend(pos3)
        self.computed_tokens += T
        # only a whole row is kept: a turn boundary's snapshot and `sync` hand it out again
        self.last_logits = logits[-1] if isinstance(logits, np.ndarray) else None
        return logits

    def prefill(self, ids, chunk: int | None = PREFILL_CHUNK, positions=None, cancel=None,
                embed_override=None) -> np.ndarray | None:
        """Append `ids` (split into runs of `chunk` tokens; None = one run, for measurements and tests
        that compare whole and chunked runs: requests take the chunked default) and return the logits
        (vocab,) after the last one. `positions` overrides the positions ((T,) or (3, T) for M-RoPE).
        `cancel` (threading.Event) is checked between chunks; on cancel the tokens run so far stay.
        `embed_override` (rows, values): input rows given as embeddings (images), see Model.forward."""
        ids = [int(t) for t in ids]
        if not ids:
            return self.last_logits
        step = len(ids) if chunk is None else int(chunk)
        if step < 1:
            raise ValueError(f"prefill chunk must be at least 1 token, got {chunk}")
        self.computed_tokens = 0
        # the executor runs the chunks (one after another, or pipelined over a split's devices) and
        # checks `cancel` before each (engine/execution.py)
        self._advance(ids, positions, rows="last", embed_override=embed_override, chunk=step,
                      cancel=cancel)
        return self.last_logits

    def score(self, ids, on_rows: Callable[[int, np.ndarray], None], chunk: int = SCORE_CHUNK,
              cancel=None) -> np.ndarray | None:
        """Run `ids` from an empty history, handing every position's logits to on_rows(start, (n, vocab))
        `chunk` positions at a time (a prompt's log-probabilities: each row is the distribution of the
        token after it), and return the logits after the last one, as sync does. The chunks are small
        because each one's logits cross to the host whole (64 x 248,320 float32: 64 MB)."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("score needs at least one token")
        self.reset()
        self.computed_tokens = 0  # each chunk's _advance counts its tokens
        for start in range(0, len(ids), chunk):
            logits = self._advance(ids[start:start + chunk], rows="all", chunk=chunk, cancel=cancel)
            on_rows(start, np.asarray(logits))
        return self.last_logits

    def step(self, token: int, top: int = 0) -> np.ndarray | TopLogits:
        """Append one token; return its logits (vocab,), or with top > 0 its `top` largest logits
        (TopLogits (1, top); what a sampler needs, engine/sampling.py Sampler.candidates)."""
        return self.launch_step(token, top).result()

    def launch_step(self, token: int, top: int = 0, pick: PickSpec | None = None) -> LaunchedStep:
        """step() without waiting for it where the device allows (the model's launch_decode): the
        token counts as appended at once; result() returns what step() returns. Take the result before
        anything else uses this session. pick (with top > 0): how the device draws the next token from
        the step's top logits (Sampler.pick_spec), so that its step can be chained (launch_next)."""
        self._settle()
        self.computed_tokens = 0
        positions, next_pos, pos3 = self._new_positions(1, None)
        launched = self.model.launch_decode(int(token), self.states, positions, top=top, pick=pick)
        self.tokens.append(int(token))
        return self._launched_now(launched, next_pos, pos3)

    def launch_next(self, prev: LaunchedStep, top: int, pick: PickSpec) -> LaunchedStep | None:
        """The step of prev's pick (drawn on the device with the PickSpec prev was launched with),
        launched on the device behind prev before the host has seen that pick (the model's
        launch_next), so the device never waits for the host between them; `pick`: how this step draws
        the token after it. prev: this session's last launch, its result not taken yet. The pick counts
        as appended at once (its id is filled in when prev's result is taken). None: not possible here
        (take prev.result() and launch_step its pick)."""
        if len(self._launched) != 1 or self._launched[0] is not prev or prev.waited:
            return None
        positions, next_pos, pos3 = self._new_positions(1, None)
        launched = self.model.launch_next(self.states, positions, top=top, pick=pick)
        if launched is None:
            return None
        self.tokens.append(_PICK_PENDING)  # prev's result writes the id (finish below)
        return self._launched_now(launched, next_pos, pos3)

    def _launched_now(self, launched: LaunchedStep, next_pos: list[int],
                      pos3: list[tuple[int, int, int]]) -> LaunchedStep:
        self._next_positions.extend(next_pos)
        self._positions.extend(pos3)
        self.computed_tokens = 1
        self.last_logits = None
        at = len(self.tokens)  # where the device's pick of this step goes if a next step is chained on it

        def finish() -> np.ndarray | TopLogits:
            try:
                out = launched.result()
            finally:  # a step that failed leaves too: its error is raised once, by this call
                if mine in self._launched:
                    self._launched.remove(mine)
            if at < len(self.tokens) and self.tokens[at] == _PICK_PENDING:
                assert isinstance(out, TopLogits) and out.picks is not None  # what launch_next fed on
                self.tokens[at] = int(out.picks[0])
            if isinstance(out, TopLogits):
                return out
            self.last_logits = np.asarray(out)[-1]
            return self.last_logits

        mine = LaunchedStep(finish)
        self._launched.append(mine)
        return mine

    def _settle(self) -> None:
        """Wait for launched steps whose results were not taken (their states are in use until then):
        every one, then the first failure among them is raised (a failed step leaves the list too)."""
        error: Exception | None = None
        while self._launched:
            try:
                self._launched[0].result()
            except Exception as exc:  # raised below, once all are settled
                error = error if error is not None else exc
        if error is not None:
            raise error

    # ---- snapshots -----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The current point (recurrent arrays copied to the host, KV by length)."""
        self._settle()
        recurrent = []
        for i, st in enumerate(self.states):
            be = self._layer_backend(i)
            recurrent.append({name: be.to_numpy(arr) for name, arr in st.recurrent.items()})
        return Snapshot(
            tokens=tuple(self.tokens),
            next_positions=tuple(self._next_positions),
            positions=tuple(self._positions),
            recurrent=tuple(recurrent),
            kv_lengths=tuple(st.kv.length if st.kv is not None else None for st in self.states),
            last_logits=None if self.last_logits is None else self.last_logits.copy(),
        )

    def can_restore(self, snap: Snapshot) -> bool:
        """True while the KV prefix the snapshot refers to is intact (its tokens prefix the history)."""
        self._settle()
        n = snap.n_tokens
        return n <= len(self.tokens) and tuple(self.tokens[:n]) == snap.tokens

    def restore(self, snap: Snapshot) -> None:
        """Return to `snap`. Raises ValueError if the history diverged before the snapshot's end."""
        self._settle()
        if not self.can_restore(snap):
            raise ValueError("snapshot no longer matches this session's history (the tokens before it "
                             "changed); take a fork() instead when you need to come back later")
        for i, st in enumerate(self.states):
            be = self._layer_backend(i)
            for name, host in snap.recurrent[i].items():
                # a copy: a host backend may wrap the array as is, and the state is updated in place,
                # which would change the snapshot for its next restore
                st.recurrent[name] = be.asarray(host.copy())
            length = snap.kv_lengths[i]
            if st.kv is not None and length is not None:
                st.kv.truncate(length)
        self.tokens = list(snap.tokens)
        self._next_positions = list(snap.next_positions)
        self._positions = list(snap.positions)
        self.last_logits = None if snap.last_logits is None else snap.last_logits.copy()

    def has_snapshot(self, ids, embed_override=None) -> bool:
        """Whether a restorable snapshot holds exactly this history (ids, image rows as for sync)."""
        wanted = tuple(self._keys(ids, embed_override))
        return any(s.tokens == wanted and self.can_restore(s) for s in self.snapshots)

    def checkpoint(self) -> None:
        """Remember the current point as a turn boundary (no-op without recurrent state, or when it is
        already remembered). Keeps the latest `max_snapshots` still-valid snapshots."""
        self._settle()
        if not self.has_recurrent_state or not self.tokens:
            return
        self.snapshots = [s for s in self.snapshots if self.can_restore(s)]
        if any(s.n_tokens == len(self.tokens) for s in self.snapshots):
            return
        self.snapshots.append(self.snapshot())
        self.snapshots.sort(key=lambda s: s.n_tokens)
        del self.snapshots[: max(0, len(self.snapshots) - self.max_snapshots)]

    def reset(self) -> None:
        """Back to an empty sequence (zero state)."""
        self._settle()
        for i, st in enumerate(self.states):
            be = self._layer_backend(i)
            for name, arr in st.recurrent.items():
                st.recurrent[name] = be.zeros(tuple(arr.shape))
            if st.kv is not None:
                st.kv.truncate(0)
        self.tokens = []
        self._next_positions = []
        self._positions = []
        self.last_logits = None

    # ---- rewinding -------------------------------------------------------------------------------------
    def _rewind(self, n: int) -> int:
        """Cheaply bring the state to at most n tokens of the current history; returns the length
        reached (<= n). Attention-only: exactly n. Recurrent: the best valid snapshot, or 0."""
        self._settle()
        if n >= len(self.tokens):
            return len(self.tokens)
        if not self.has_recurrent_state:
            for st in self.states:
                if st.kv is not None:
                    st.kv.truncate(n)
            del self.tokens[n:]
            del self._next_positions[n:]
            del self._positions[n:]
            self.last_logits = None
            return n
        usable = [s for s in self.snapshots if s.n_tokens <= n and self.can_restore(s)]
        if usable:
            self.restore(max(usable, key=lambda s: s.n_tokens))
        else:
            self.reset()
        return len(self.tokens)

    def truncate(self, n_tokens: int, chunk: int | None = PREFILL_CHUNK) -> None:
        """Keep only the first n_tokens of the history (re-prefilling from a snapshot where needed)."""
        self._settle()
        n = int(n_tokens)
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot truncate a session of {len(self.tokens)} tokens to {n}")
        known = list(self.tokens[:n])
        known_pos = list(self._positions[:n])
        reached = self._rewind(n)
        if reached < n:
            ids, override = self._ids_and_override(known[reached:])
            positions = np.array(known_pos[reached:], dtype=np.int64).T  # (3, m): exact, images too
            self.prefill(ids, chunk=chunk, positions=positions, embed_override=override)

    def sync(self, ids, chunk: int | None = PREFILL_CHUNK, cancel=None, positions=None,
             embed_override=None) -> np.ndarray:
        """Make the history equal to `ids` and return the logits (vocab,) after its last token.

        Reuses the longest common prefix with the current history; `computed_tokens` tells how many
        tokens actually ran. `positions` ((T,) or (3, T)) and `embed_override` describe the whole
        prompt, as for prefill; rows given as embeddings match only the same embeddings."""
        self._settle()
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("sync needs at least one token")
        keys = self._keys(ids, embed_override)
        common = 0
        limit = min(len(keys), len(self.tokens))
        while common < limit and keys[common] == self.tokens[common]:
            common += 1
        if common == len(ids) == len(self.tokens) and self.last_logits is not None:
            self.computed_tokens = 0
            return self.last_logits
        # Rewind to `common`, but keep at least one token to run, so there are logits to return
        # (unless a snapshot exactly at len(ids) carries them).
        exact = [s for s in self.snapshots if s.tokens == tuple(keys) and s.last_logits is not None
                 and self.can_restore(s)]
        if common == len(ids) and exact:
            snap = exact[0]
            assert snap.last_logits is not None  # `exact` keeps only snapshots that have them
            self.restore(snap)
            self.computed_tokens = 0
            return snap.last_logits.copy()
        target = common if common < len(ids) else len(ids) - 1
        reached = self._rewind(target)
        pos = None if positions is None else np.asarray(positions)[..., reached:]
        logits = self.prefill(ids[reached:], chunk=chunk, cancel=cancel, positions=pos,
                              embed_override=shift_override(embed_override, reached, len(ids)))
        assert logits is not None  # at least one token ran (see `target` above)
        return logits

    # ---- copies ----------------------------------------------------------------------------------------
    def fork(self) -> Session:
        """An independent session with the same history and state (KV caches copied on their devices)."""
        self._settle()
        twin = Session.__new__(Session)
        twin.model = self.model
        twin.capacity = self.capacity
        twin.states = []
        for i, st in enumerate(self.states):
            be = self._layer_backend(i)
            twin.states.append(LayerState(
                kv=st.kv.clone() if st.kv is not None else None,
                recurrent={name: be.asarray(be.to_numpy(arr)) for name, arr in st.recurrent.items()},
            ))
        twin.tokens = list(self.tokens)
        twin._next_positions = list(self._next_positions)
        twin._positions = list(self._positions)
        twin._row_values = dict(self._row_values)
        twin.last_logits = None if self.last_logits is None else self.last_logits.copy()
        twin.max_snapshots = self.max_snapshots
        twin.snapshots = list(self.snapshots)  # immutable host data; validity is checked per session
        twin.computed_tokens = 0
        twin._launched = []
        return twin

    def close(self) -> None:
        """Release device memory held by this session's state."""
        try:
            self._settle()  # a launched step still uses the states (its error, if any, is raised after)
        finally:
            self.model._free_states(self.states)
            self.states = []
            self.snapshots = []
