"""Continuous batching: many concurrent generations on one model, their decode steps run as one batch.

Each request generates on its caller's thread with the ordinary generate loop (engine/generation.py:
prompt, sampler, stop strings, events) on a Session whose model is this scheduler's `BatchedModel`.
That view routes the session's forward passes to one scheduler thread, which owns the executor and
runs a *step* at a time:

- every sequence waiting for its next token is one row of the step; all of them go through
  `Executor.forward_batch` together, so the projections and FFN read each weight once for the batch;
- prompts are prefilled in chunks, at most `chunk` prompt tokens per step (oldest prompt first, so
  several short prompts share one step), in the same pass as the decoding rows: a new request never
  stalls the others for more than one chunk, and joins the batch as soon as its prompt is in;
- a step starts when every admitted sequence has asked for its next pass (or `gather_s` after the
  first asked: a sequence that is busy elsewhere, or finishing, does not hold the others up);
- a finished, cancelled or failed generation leaves at once (its thread stops asking); a prefill
  whose cancel event is set ends at the next chunk boundary with GenerationCancelled(tokens_done);
- a generation running alone (no other admitted, no pass waiting) launches its decode steps itself,
  as a generation outside the scheduler does (`Scheduler.alone`): on a GPU each step is then chained
  behind the one before on the device (Executor.launch_next) instead of going through this thread's
  steps one at a time. The next request to arrive makes its steps batched again;
- a batched generation whose sampler chains (greedy or top-k, with or without penalties that only
  lower logits) hands in its next decode pass before it has seen the token that pass embeds
  (`BatchedModel.launch_next`): that token is the draw its sampler will make from the pass before
  (`_Pass.pick_token`, the sampler's own arithmetic; with penalties over the history up to that pass),
  which this thread makes itself as soon as that pass ran, before it wakes any generation's thread (they
  would compete with it for the interpreter). So the step after runs at once, while the callers'
  threads take their tokens, instead of waiting for every one of them to pick and ask again.

Admission: at most `parallel` generations run at once; later ones wait in FIFO order, at most
`max_queue` of them, and past that `generate` raises QueueFull (the server's 429 + Retry-After).
A prefix cache (engine/prefix_cache.py) may hand a new request a session that already holds a
shared start of its prompt.

What this is not: the forward pass (engine/execution.py), the sampler or the generate loop, the
request/event plumbing of the runtime (engine/runtime.py), or HTTP.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .errors import GenerationCancelled, OutOfDeviceMemory, RequestError
from .execution import Override, shift_override
from .generation import GenerationEvent, check_fits_context, generate
from .prefix_cache import CacheStart, PrefixCache
from .prompt import PromptInput
from .sampling import (
    LaunchedStep,
    PenaltyView,
    PickSpec,
    SamplingParams,
    TopLogits,
    draw_from_top,
    pick_penalized,
    top_logits,
)
from .session import Session

_T = TypeVar("_T")

if TYPE_CHECKING:
    from .model import Model

DEFAULT_CHUNK = 128  # prompt tokens per step: bounds how long a new prompt stalls the running decodes
RATE_WINDOW_S = 10.0  # decode tokens/s is measured over the steps of this many seconds
CHAINED = -1  # the token of a chained pass until the scheduler draws it (_Pass.after)


# Arrays at least this large are mapped from (and unmapped back to) the OS on every allocation (glibc
# mallopt M_MMAP_THRESHOLD). Without a fixed threshold glibc raises it to the size of the largest
# array freed so far, and then every request thread keeps its own heap of megabyte-sized logit rows
# and sampler scratch: resident memory grew by half a gigabyte under 8 concurrent clients.
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def fix_mmap_threshold(n_bytes: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold (see MMAP_THRESHOLD); False where the C library has no mallopt
    (macOS, Windows, musl), which leaves the allocator as it is."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(n_bytes)))
    except (OSError, AttributeError):  # no C library handle, or no mallopt in it
        return False


class QueueFull(RequestError):
    """Every generation slot is busy and the queue is full. `retry_after`: seconds worth waiting."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _cancelled(tokens_done: int) -> GenerationCancelled:
    exc = GenerationCancelled("prefill cancelled")
    exc.tokens_done = tokens_done
    return exc


@dataclass(eq=False)
class _Pass:
    """One forward call of one session, waiting for (or part way through) the scheduler's steps."""

    ids: list[int]
    states: list
    positions: np.ndarray  # (T,) or (3, T)
    chunk: int
    cancel: threading.Event | None
    override: Override | None
    top: int = 0  # > 0: the pass needs only the last row's `top` largest logits (Session.step)
    done: int = 0  # tokens already run (a prefill runs a chunk per step)
    logits: np.ndarray | TopLogits | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    # a decode pass of a sampler that chains (top > 0): how its generation draws the token after this
    # pass from its top logits, so that a pass chained on it can be given that token here
    pick: PickSpec | None = None
    # a chained pass: its token is `after`'s pick, drawn once `after` ran (then `after` is let go)
    after: _Pass | None = None
    chained: bool = False  # made with `after` (its token is not in its pick's history yet)
    # its logits (or error) are in: a pass chained on it can run, though its caller may not be woken
    # yet (`finished`: Scheduler._complete)
    ran: bool = False
    # a pick with penalties (pick.history): the history's generated tokens when the pass was handed in
    # (then its own token, when chained, follows them), and the penalties' view of the history, made by
    # the first pass of a chain and handed along it (each pass's draw extends it)
    counted: int = 0
    view: PenaltyView | None = None
    _picked: int | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.ids) == 1 and self.override is None

    @property
    def ready(self) -> bool:
        """Whether the pass can be a row of the next step (a chained pass: once the pass before ran)."""
        after = self.after
        return after is None or after.ran

    def top_logits(self) -> TopLogits:
        """The pass's logits as top logits (of `top` columns at least; made on the host from the whole
        row when the step returned rows), once it ran without error."""
        out = self.logits
        if isinstance(out, TopLogits):
            return out
        row = np.asarray(out, np.float32).reshape(-1)
        vals, ids = top_logits(row, self.top)
        top = TopLogits(vals, ids, fetch=lambda _r: row)
        self.logits = top
        return top

    def take(self, out: np.ndarray | TopLogits, b: int) -> None:
        """Its logits from row b of the step it ended in, and the token its pick draws from them: then it
        ran. A failure in either is the pass's error (its generation's, and a pass chained on it), not
        the scheduler's."""
        try:
            if not isinstance(out, TopLogits):  # a copy: a view would keep the whole (B, vocab) array alive
                self.logits = out[b : b + 1].copy()
            elif self.top:
                self.logits = out.row(b)
            else:  # its whole row, read now (a copy kept with the step's top logits): the next step replaces it
                self.logits = out.whole_row(b)[None, :]
            if self.pick is not None:
                self.pick_token()
        except Exception as exc:
            self.error = exc
        self.ran = True

    def pick_token(self) -> int:
        """The token the pick draws from this pass's logits once it ran: what its sampler draws from
        them (engine/sampling.py Sampler._pick_top: draw_from_top over the first `top`, or with
        penalties pick_penalized over the history up to this pass's token), drawn once."""
        if self._picked is None:
            spec = self.pick
            assert spec is not None
            top = self.top_logits()
            if spec.history is None:
                self._picked = draw_from_top(top.values[0, : self.top], top.ids[0, : self.top], spec)
            else:
                self._picked = self._pick_penalized(top, spec)
        return self._picked

    def _pick_penalized(self, top: TopLogits, spec: PickSpec) -> int:
        history, view = spec.history, self.view
        assert history is not None and view is not None and view.tokens <= self.counted
        assert not top.penalized  # a step of the scheduler's applies no penalties
        view.add(history.generated[view.tokens : self.counted])
        if self.chained:
            view.add(self.ids)
        # the whole row, if the pick reads it, is read now (the sequence's next step replaces it) and kept
        # with the top logits for the sampler's own pick (TopLogits.whole_row)
        return pick_penalized(top, spec, view, self.top)

    def result(self) -> np.ndarray | TopLogits:
        """What the pass's session gets once it ran (its error, raised, if it failed); a pass with a
        pick gives its top logits with that pick (TopLogits.picks), which a pass chained on it embeds."""
        out = Scheduler.wait_pass(self)
        if self.pick is None:
            return out
        return replace(self.top_logits(), picks=np.array([self.pick_token()], np.int64))


def _cache_accounted(ev: GenerationEvent, start: CacheStart) -> GenerationEvent:
    """An event of a generation whose session the prefix cache prepared: the tokens the cache
    prefilled to extend itself were computed for this request, not cached, and took their time."""
    computed_in_loop = ev.prompt_tokens - ev.cached_tokens
    loop_s = computed_in_loop / ev.prompt_tps if ev.prompt_tps else 0.0
    computed = computed_in_loop + start.prefilled_tokens
    seconds = loop_s + start.prefill_s
    return replace(ev, cached_tokens=ev.cached_tokens - start.prefilled_tokens,
                   prompt_tps=computed / seconds if computed and seconds > 0 else None,
                   elapsed=ev.elapsed + start.prefill_s)


class _Stream(Iterator[GenerationEvent]):
    """The events of one generation. Until it is first iterated its caller holds a place in the
    queue; closing (or dropping) it before that gives the place up, so nobody behind it waits on a
    stream no one reads."""

    def __init__(self, scheduler: Scheduler, ticket: int, events: Generator[GenerationEvent, None, None]):
        self._scheduler = scheduler
        self._ticket = ticket
        self._events = events
        self._started = False

    def __next__(self) -> GenerationEvent:
        self._started = True
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        if not self._started:
            self._started = True
            self._scheduler._leave_queue(self._ticket)

    def __del__(self) -> None:
        self.close()


def _drawn_here(pick: PickSpec | None, top: int) -> PickSpec | None:
    """The pick when the scheduler can draw it from a pass's top logits itself (_Pass.pick_token: top >
    0; with penalties, from the candidates or the whole row), else None."""
    return pick if pick is not None and top > 0 else None


class BatchedModel:
    """The model as a Session of the scheduler sees it: its forward passes become rows of the
    scheduler's steps; state allocation and freeing go to the model itself."""

    def __init__(self, scheduler: Scheduler, model: Model):
        self.scheduler = scheduler
        self.model = model
        # each session's last decode pass through the scheduler, while it is its last step (by the id of
        # its states list; an entry goes with its pass, which holds that list): a next pass may chain on
        # it, and a step the model launches itself may not (the device never saw its pick)
        self._tails: weakref.WeakValueDictionary[int, _Pass] = weakref.WeakValueDictionary()

    @property
    def config(self):  # the model's: a session reads its context limit from it (engine/session.py)
        return self.model.config

    @property
    def placement(self):
        return self.model.placement

    def forward(self, ids, states, positions, *, rows: str | None = "last", hidden_hook=None,
                chunk: int | None = None, cancel=None, embed_override=None, top: int = 0):
        """As Model.forward. Passes that want more than the last row, or a hidden-state hook, run
        directly (serialized with the steps by the executor's lock)."""
        self._tails.pop(id(states), None)
        if rows != "last" or hidden_hook is not None:
            return self.model.forward(ids, states, positions, rows=rows, hidden_hook=hidden_hook,
                                      chunk=chunk, cancel=cancel, embed_override=embed_override, top=top)
        return self.scheduler.run_pass(ids, states, positions, chunk=chunk, cancel=cancel,
                                       embed_override=embed_override, top=top)

    def launch_decode(self, token: int, states, positions, top: int = 0,
                      pick: PickSpec | None = None) -> LaunchedStep:
        """As Model.launch_decode: the pass joins the coming steps at once and result() waits for it,
        so the caller's thread works (hands out its previous token) while the step gathers and runs.
        A generation running alone launches the step itself (Scheduler.alone), with its pick."""
        self._tails.pop(id(states), None)
        if self.scheduler.alone():
            self.scheduler.count_alone()
            return self.model.launch_decode(token, states, positions, top=top, pick=pick)
        work = self.scheduler.submit_pass([int(token)], states, positions, chunk=None, cancel=None,
                                          embed_override=None, top=top, pick=_drawn_here(pick, top))
        self._tails[id(states)] = work
        return LaunchedStep(work.result)

    def launch_next(self, states, positions, top: int, pick: PickSpec) -> LaunchedStep | None:
        """As Model.launch_next. For a generation running alone (Scheduler.alone) after a step the
        model launched itself: the model's own (chained on the device). For a batched one after a pass
        of this scheduler's with a pick: a pass chained on that one, whose token is that pick, drawn
        by the scheduler as soon as that pass ran (_Pass.pick_token). None otherwise, the caller then
        takes its last step's result and launches its pick with launch_decode: a batched generation
        whose sampler needs whole rows, and one that runs alone by now after a batched pass (the
        device never saw that pass's pick; its next launch_decode goes to the model, and the
        launch_next after that chains on the device again)."""
        prev = self._tails.pop(id(states), None)
        if self.scheduler.alone():
            if prev is not None:
                return None
            launched = self.model.launch_next(states, positions, top=top, pick=pick)
            if launched is not None:
                self.scheduler.count_alone()
            return launched
        if prev is None or prev.pick is None or _drawn_here(pick, top) is None:
            return None
        work = self.scheduler.submit_pass([CHAINED], states, positions, chunk=None, cancel=None,
                                          embed_override=None, top=top, pick=pick, after=prev)
        self._tails[id(states)] = work
        return LaunchedStep(work.result)

    def new_state(self, capacity: int | None = None, kv_type: str | None = None) -> list:
        return self.model.new_state(capacity, kv_type=kv_type)

    def backend_of(self, part: str):
        return self.model.backend_of(part)

    def _free_states(self, states: list) -> None:  # Session.close frees through its model
        self.model._free_states(states)


@dataclass
class _Step:
    """A step in flight: its rows (passes), each row's tokens in it, the decode rows, prompt tokens and
    chained passes among them, and the executor's launch."""

    rows: list[_Pass]
    sizes: list[int]
    decodes: int
    prefilled: int
    chained: int
    launched: LaunchedStep


@dataclass
class _Counters:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    rows_last: int = 0  # sequences in the last step
    sequences_sum: int = 0  # sum over steps of the sequences in each (mean batch size)
    max_batch: int = 0
    rejected: int = 0  # QueueFull raised
    finished: int = 0
    memory_waits: int = 0  # admitted generations that waited for another to end before their memory
    alone_steps: int = 0  # of the steps, decode steps a generation running alone launched itself
    chained_passes: int = 0  # decode rows whose token this thread drew (a pass chained on the one before)
    recent: deque = field(default_factory=deque)  # (time, decode tokens) of recent steps


def _cancelled_before_start(t0: float) -> GenerationEvent:
    """The one event of a generation cancelled before its first pass (t0: when it was asked for)."""
    return GenerationEvent(token=None, text="", finish_reason="cancelled", prompt_tokens=0, generated_tokens=0,
                           prompt_tps=None, generation_tps=None, elapsed=time.perf_counter() - t0)


class Scheduler:
    """Runs the generations of many callers on one model (see the module docstring).

    parallel: generations running at once; max_queue: callers allowed to wait for a slot; chunk:
    prompt tokens per step; gather_s: how long a step waits for the slowest running sequence;
    prefix_cache: shared prompt starts across requests (engine/prefix_cache.py) or None."""

    def __init__(self, model: Model, *, parallel: int = 4, max_queue: int = 16,
                 chunk: int = DEFAULT_CHUNK, gather_s: float = 0.05,
                 prefix_cache: PrefixCache | None = None):
        if parallel < 1 or max_queue < 0 or chunk < 1:
            raise ValueError("parallel and chunk must be at least 1, max_queue at least 0")
        fix_mmap_threshold()  # many request threads: big arrays must go back to the OS when freed
        self.model = model
        self.view = BatchedModel(self, model)
        self.parallel = int(parallel)
        self.max_queue = int(max_queue)
        # prompt tokens per step: at least the executor's shortest prefill run (streamed host-RAM experts
        # copy every host-held layer once per run, engine/execution.py min_chunk)
        self.chunk = max(int(chunk), model.executor.min_chunk)
        self.gather_s = float(gather_s)
        self.prefix_cache = prefix_cache
        self._cond = threading.Condition()
        self._passes: list[_Pass] = []
        self._running = 0  # admitted generations
        self._holding = 0  # of those, the ones holding a session (memory another may wait for)
        self._queue: deque[int] = deque()  # tickets of callers waiting for a slot, in order
        self._tickets = itertools.count()
        self._closed = False
        self._counters = _Counters()
        self._thread = threading.Thread(target=self._loop, name="minecart-scheduler", daemon=True)
        self._thread.start()

    # ---- callers' side -------------------------------------------------------------------------------
    def new_session(self, capacity: int | None = None) -> Session:
        """A session whose passes run through this scheduler (give it to `generate` to keep a
        conversation's state between turns)."""
        return Session(self.view, capacity=capacity)

    def generate(self, prompt: PromptInput, params: SamplingParams | None = None, *,
                 session: Session | None = None, cancel: threading.Event | None = None,
                 enable_thinking: bool = True, **extras: Any) -> Iterator[GenerationEvent]:
        """GenerationEvents as engine.generation.generate yields them, with this request's passes
        batched with everyone else's. Raises QueueFull now (not when iterated) when every slot is
        busy and `max_queue` callers already wait. Without a session the request gets a fresh one
        (from the prefix cache when there is one), closed at the end."""
        with self._cond:
            if self._closed:
                raise RequestError("the scheduler is shut down")
            if self._running >= self.parallel and len(self._queue) >= self.max_queue:
                self._counters.rejected += 1
                raise QueueFull(f"all {self.parallel} generation slots are busy and {len(self._queue)} "
                                "requests are waiting; retry later", self.retry_after())
            ticket = next(self._tickets)
            self._queue.append(ticket)
        return _Stream(self, ticket,
                       self._generate(ticket, prompt, params, session, cancel, enable_thinking, extras))

    def _leave_queue(self, ticket: int) -> None:
        """Give up a place in the queue that was never used (a stream closed before its first event)."""
        with self._cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def retry_after(self) -> int:
        """Seconds a rejected caller should wait: about one queue's worth of generations."""
        return max(1, min(60, 1 + len(self._queue) // max(1, self.parallel)))

    def _generate(self, ticket: int, prompt, params, session, cancel, enable_thinking: bool,
                  extras: dict[str, Any]) -> Generator[GenerationEvent, None, None]:
        t0 = time.perf_counter()
        admitted = self._wait_for_slot(ticket, cancel)
        if not admitted:
            yield _cancelled_before_start(t0)
            return
        own = session is None
        start: CacheStart | None = None
        holds = False
        try:
            if session is None and self.prefix_cache is not None and set(extras) <= {"turn_boundary"} \
                    and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                # a one-off session is not kept, so no later turn comes back to a turn boundary
                extras = {}
                check_fits_context(self.model, len(prompt))  # before the cache prefills its blocks
                cache = self.prefix_cache
                start = self._with_memory(lambda: cache.start(self.new_session, prompt, cancel), cancel)
                session = None if start is None else start.session
            elif session is None:
                session = self._with_memory(self.new_session, cancel)
            if session is None:  # cancelled (or shut down) while it waited for memory
                yield _cancelled_before_start(t0)
                return
            with self._cond:
                self._holding += 1
                holds = True
            for ev in generate(self.model, prompt, params, session=session, cancel=cancel,
                               enable_thinking=enable_thinking, **extras):
                yield ev if start is None else _cache_accounted(ev, start)
        finally:
            if own and session is not None:
                session.close()
            with self._cond:
                self._running -= 1
                if holds:
                    self._holding -= 1
                self._counters.finished += 1
                self._cond.notify_all()

    def _with_memory(self, make: Callable[[], _T], cancel: threading.Event | None) -> _T | None:
        """make() (a request's new session, or its start from the prefix cache), waiting for memory
        when the devices have none left for it: the prefix cache's entries go first, then the request
        waits until another generation holding a session ends and tries again. When none holds one
        (nothing could free memory; two requests that both found none do not wait for each other) the
        error is raised, saying what each request holds. None: cancelled or shut down while waiting."""
        tried_cache = False
        while True:
            try:
                return make()
            except (OutOfDeviceMemory, MemoryError) as exc:
                if not tried_cache and self.prefix_cache is not None and self.prefix_cache.nbytes:
                    tried_cache = True
                    self.prefix_cache.clear()  # its holders' KV caches and snapshots
                    continue
                with self._cond:
                    if not self._holding:  # nothing running holds memory that its end would free
                        if self.parallel == 1:
                            raise
                        raise OutOfDeviceMemory(
                            f"{exc} (each of the {self.parallel} generations allowed at once holds its own "
                            "KV cache: lower --parallel / \"Requests at once\" or the context)") from exc
                    self._counters.memory_waits += 1
                    ended = self._counters.finished
                    while self._counters.finished == ended:
                        if self._closed or (cancel is not None and cancel.is_set()):
                            return None
                        self._cond.wait(0.1)
                tried_cache = False

    def _wait_for_slot(self, ticket: int, cancel: threading.Event | None) -> bool:
        """Block until `ticket` is first in line and a slot is free (True), or cancel / shutdown
        (False). The wait re-checks cancel a few times a second."""
        with self._cond:
            while True:
                if self._closed or (cancel is not None and cancel.is_set()):
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                    return False
                if self._queue[0] == ticket and self._running < self.parallel:
                    self._queue.popleft()
                    self._running += 1
                    self._cond.notify_all()
                    return True
                self._cond.wait(0.1)

    def run_pass(self, ids: Sequence[int], states: list, positions, *, chunk: int | None,
                 cancel: threading.Event | None, embed_override: Override | None,
                 top: int = 0) -> np.ndarray | TopLogits:
        """One session's forward pass (last-row logits, or their `top` largest) as rows of the coming
        steps; blocks until its last chunk ran. Called by BatchedModel.forward on the caller's thread."""
        work = self.submit_pass(ids, states, positions, chunk=chunk, cancel=cancel,
                                embed_override=embed_override, top=top)
        return self.wait_pass(work)

    def submit_pass(self, ids: Sequence[int], states: list, positions, *, chunk: int | None,
                    cancel: threading.Event | None, embed_override: Override | None, top: int = 0,
                    pick: PickSpec | None = None, after: _Pass | None = None) -> _Pass:
        """run_pass without its wait: the pass joins the coming steps; wait_pass(work) waits for it.
        pick / after: see _Pass (after: ids is [CHAINED], the token drawn from `after`)."""
        step = self.chunk if not chunk else min(int(chunk), self.chunk)
        work = _Pass([int(t) for t in ids], states, np.asarray(positions), step, cancel, embed_override,
                     int(top), pick=pick, after=after, chained=after is not None)
        if pick is not None and pick.history is not None:
            work.counted = len(pick.history.generated)
            if after is None:  # the first pass of a chain (a chained one takes `after`'s view)
                work.view = PenaltyView(pick.history.prompt_ids)
        if threading.current_thread() is self._thread:
            raise RuntimeError("the scheduler thread cannot wait for its own steps")
        with self._cond:
            if self._closed:
                raise GenerationCancelled("the scheduler is shut down")
            self._passes.append(work)
            self._cond.notify_all()
        return work

    @staticmethod
    def wait_pass(work: _Pass) -> np.ndarray | TopLogits:
        """The logits of a submitted pass, once its last chunk ran (its error, raised, if it failed)."""
        work.finished.wait()
        if work.error is not None:
            raise work.error
        assert work.logits is not None
        return work.logits

    def alone(self) -> bool:
        """Whether the one generation running may launch its decode step itself instead of through
        this thread's steps: no other generation admitted and no pass waiting (a step of one sequence
        would be that one's anyway, one thread hand-off later and never chained on the device)."""
        with self._cond:
            return not self._closed and self._running == 1 and not self._passes

    def count_alone(self) -> None:
        """Count a decode step a lone generation launched itself as a step of one sequence."""
        self._count(1, 0, 1)
        with self._cond:
            self._counters.alone_steps += 1

    # ---- the scheduler thread ------------------------------------------------------------------------
    def _ready(self) -> list[_Pass]:
        return [w for w in self._passes if w.ready]

    def _loop(self) -> None:
        # the passes that ended in the last step, when every running generation had its next pass ready
        # then: their callers are woken once the next step is launched, so that their threads' turns at
        # the interpreter fall while the device computes, not between two steps
        unwoken: list[_Pass] = []
        while True:
            with self._cond:
                if unwoken and not self._ready():  # no step to launch first: their callers wake now
                    self._wake(unwoken)
                    unwoken = []
                while not self._passes and not self._closed:
                    self._cond.wait()
                if self._closed:
                    pending, self._passes = self._passes, []
                    break
                # a generation has at most one ready pass (a pass chained on another is ready once that
                # one ran), so a step waits for as many as there are generations
                deadline = time.monotonic() + self.gather_s
                while not unwoken and len(self._ready()) < self._running and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                passes = self._ready()
            launched = self._launch(passes)
            self._wake(unwoken)
            unwoken = self._complete(launched) if launched is not None else []
        self._wake(unwoken)
        for work in pending:
            self._finish(work, error=GenerationCancelled("the scheduler is shut down"))

    @staticmethod
    def _wake(ended: list[_Pass]) -> None:
        for w in ended:
            w.finished.set()

    def _finish(self, work: _Pass, logits: np.ndarray | TopLogits | None = None,
                error: BaseException | None = None) -> None:
        work.logits, work.error, work.ran = logits, error, True
        with self._cond:
            if work in self._passes:
                self._passes.remove(work)
        work.finished.set()

    def _launch(self, passes: list[_Pass]) -> _Step | None:
        """Launch one forward pass over every waiting decode row plus prompt chunks, oldest prompt first,
        up to `chunk` prompt tokens in all (so a step's cost stays bounded whatever arrives). None:
        nothing to run, or the launch failed (its rows have the error)."""
        chained = 0
        for w in passes:
            if w.after is not None:  # its token: the pick of the pass before, which ran
                after, w.after = w.after, None
                if after.error is not None:
                    self._finish(w, error=after.error)
                    continue
                w.ids = [after.pick_token()]
                w.view = after.view
                chained += 1
        # the same sequences in the same order step after step (a batch graph keeps its binding)
        decodes = sorted((w for w in passes if w.is_decode and not w.ran), key=lambda w: id(w.states))
        rows = list(decodes)
        ids, states, positions = [], [], []
        for w in decodes:
            ids.append(w.ids)
            states.append(w.states)
            positions.append(w.positions)
        budget = self.chunk
        prefilled = 0
        for w in passes:
            if w.is_decode or budget <= 0:
                continue
            if w.cancel is not None and w.cancel.is_set():
                self._finish(w, error=_cancelled(w.done))
                continue
            if w.override is not None:  # image rows: alone, through Executor.forward
                if not prefilled:
                    self._run_override_chunk(w)
                    budget = 0
                continue
            stop = min(len(w.ids), w.done + w.chunk, w.done + budget)
            rows.append(w)
            ids.append(w.ids[w.done : stop])
            states.append(w.states)
            positions.append(w.positions[..., w.done : stop])
            budget -= stop - w.done
            prefilled += stop - w.done
        if not rows:
            return None
        # the largest logits, as many as the most any row that ends its pass here asks; a row whose
        # sampler takes whole rows (a prompt's last chunk, top-k off) reads its own through the step's
        # fetch (_complete), so one such row does not make the step copy every row whole. Whole rows
        # for all only when no ending row takes top logits; one logit when no row ends its pass here.
        top = max((w.top for b, w in enumerate(rows) if w.done + len(ids[b]) == len(w.ids)), default=1)
        try:
            launched = self.model.executor.launch_batch(ids, states, positions, top=top)
        except BaseException as exc:  # every caller in the step gets the failure
            for w in rows:
                self._finish(w, error=exc)
            return None
        return _Step(rows, [len(t) for t in ids], len(decodes), prefilled, chained, launched)

    def _complete(self, step: _Step) -> list[_Pass]:
        """Take a launched step's output: each row's logits, and the token each pick draws from them
        (before any generation's thread wakes: they would compete with this thread for the
        interpreter, and the pass chained on the row needs it for the next step). Returns the passes
        that ended, for their callers to be woken after the next launch, when every running generation
        has its next pass ready now (else they are woken here and nothing is returned)."""
        try:
            out = step.launched.result()
        except BaseException as exc:  # every caller in the step gets the failure
            for w in step.rows:
                self._finish(w, error=exc)
            return []
        ended = []
        for b, w in enumerate(step.rows):
            w.done += step.sizes[b]
            if w.done == len(w.ids):
                w.take(out, b)
                ended.append(w)
        self._count(step.decodes, step.prefilled, len(step.rows))
        with self._cond:
            self._counters.chained_passes += step.chained
            gone = {id(w) for w in ended}
            self._passes = [w for w in self._passes if id(w) not in gone]
            defer = bool(ended) and not self._closed and len(self._ready()) >= self._running
        if defer:
            return ended
        self._wake(ended)
        return []

    def _run_override_chunk(self, w: _Pass) -> None:
        stop = min(len(w.ids), w.done + w.chunk)
        try:
            out = self.model.forward(w.ids[w.done : stop], w.states, w.positions[..., w.done : stop],
                                     rows="last", embed_override=shift_override(w.override, w.done, stop))
        except BaseException as exc:
            self._finish(w, error=exc)
            return
        self._count(0, stop - w.done, 1)
        w.done = stop
        if w.done == len(w.ids):
            self._finish(w, logits=out)

    def _count(self, decoded: int, prefilled: int, sequences: int) -> None:
        now = time.monotonic()
        with self._cond:
            c = self._counters
            c.steps += 1
            c.decode_tokens += decoded
            c.prefill_tokens += prefilled
            c.rows_last = sequences
            c.sequences_sum += sequences
            c.max_batch = max(c.max_batch, sequences)
            c.recent.append((now, decoded))
            while c.recent and c.recent[0][0] < now - RATE_WINDOW_S:
                c.recent.popleft()

    # ---- observation and shutdown --------------------------------------------------------------------
    def metrics(self) -> dict[str, float | int]:
        """Counters for /metrics: queue depth, running generations, batch sizes, decode tokens/s over
        the last RATE_WINDOW_S seconds, totals; the prefix cache's hit counts when there is one."""
        with self._cond:
            c = self._counters
            span = (c.recent[-1][0] - c.recent[0][0]) if len(c.recent) > 1 else 0.0
            rate = sum(n for _, n in list(c.recent)[1:]) / span if span > 0 else 0.0
            out: dict[str, float | int] = {
                "queue_depth": len(self._queue),
                "running": self._running,
                "parallel": self.parallel,
                "batch_size": c.rows_last,
                "batch_size_max": c.max_batch,
                "batch_size_mean": c.sequences_sum / c.steps if c.steps else 0.0,
                "steps": c.steps,
                "decode_tokens": c.decode_tokens,
                "prefill_tokens": c.prefill_tokens,
                "decode_tokens_per_s": rate,
                "rejected": c.rejected,
                "finished": c.finished,
                "memory_waits": c.memory_waits,
                "alone_steps": c.alone_steps,
                "chained_passes": c.chained_passes,
            }
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler thread: waiting callers and passes in flight end with
        GenerationCancelled (a generation ends with a "cancelled" event)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed
