"""A pool of CPU threads that stays up and serves routed-expert calls posted into shared memory.

Why. A GPU whose layers keep their routed experts in host RAM goes to the CPU once per MoE layer of
every decode token. As stream work (a copy, a driver host function, a copy back) that round trip
cost ~0.2 ms a layer beyond the experts themselves on the H200's host (docs/BENCHMARKS.md v13): the
driver's host-function thread, its Python entry, and two starts of numba's parallel regions, 30 times
a token. Here the threads never stop between calls: they wait on a word of page-locked memory, which
the GPU itself writes (kernels/expert_call.cu), run the experts with the integer kernels of
engine/cpu_experts.py, and write a word back that the GPU waits on. No driver call, no Python, no
thread start on the way.

The shared memory (`ctrl`, int64 words, page-locked so the GPU reads and writes it over the bus):

- per channel (a GPU's proxy, `ExpertChannel`; MAX_CHANNELS of them), 16 words from
  CHANNEL_BASE + 16 c:
  - REQ (the GPU writes it last, after ENTRY, T, X and Y): the request's sequence number;
  - ENTRY (a layer registered with `add_entry`), T (tokens), X and Y (host addresses of the rows:
    X (T, W) float32, W = H + 2k, each token's values then its k expert ids and weights as the GPU's
    routing gives them; Y (T, H) float32 for the output), W;
  - DONE (the pool writes it when Y is complete): the sequence number served;
  - STATUS, BAD (the pool: 1 + the slot of an expert id that is not an expert's, and the id's float32
    bits; that token's row is NaN), TIMEOUT (the GPU: the sequence number it stopped waiting for);
  - the GPU's clock: NOW (this call's start, written with the request), then START, POSTED, SEEN and
    END of the last finished call (written as it ends); the leader adds them up (`profile`);
- global words: STOP, the job's generation / channel / sequence number (the leader, thread 0,
  hands every thread the same request), a barrier's count and generation, SPIN (how many polls an
  idle thread spins before it starts to nap between polls: 50 us naps, then 1 ms, then 5 ms, so an
  idle pool leaves the cores to others).

Each request runs token after token; a token is the one-call kernel's work (`routed_experts`) split
over the threads with barriers in between: x quantized (each thread its own copy: cheaper than a
barrier), gate and up jobs in contiguous runs per thread, taken 32 rows at a time through a counter
per run so that a thread done early takes the rest of the others' runs (work stealing: a thread the
system holds up no longer holds the rest at the barrier), SwiGLU and h's quantization a slot per
thread, then one down-sum job per thread. Every row is computed by the same job functions as the
one-call kernel and in the same order, whichever thread runs it, so the pool's output equals
`routed_experts` bit for bit (tests/engine/test_expert_pool.py).

Memory order: the GPU writes the rows, fences (system scope), then writes REQ; the threads read REQ
with an acquire load. The threads write Y and meet at the barrier that ends the down-sum, and the
leader writes DONE with a release store; the GPU reads DONE (volatile), fences, then reads Y.

What this is not: the GPU side (kernels/expert_call.cu), the routing (the GPU's `moe_route`), or a
general thread pool. Entries are the layers of models loaded now; adding or dropping one stops the
threads, and the next `ensure_running` starts them with the new table.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cpu_experts as ce
from .threads import usable_cores

MAX_CHANNELS = 8
# global words, each hot one on its own 64-byte line
STOP = 0
SPIN = 1
JOB_GEN, JOB_CH, JOB_SEQ = 8, 9, 10
BAR_COUNT = 16
BAR_GEN = 24
CHANNEL_BASE = 32
CHANNEL_WORDS = 16
# channel words
REQ, ENTRY, T_WORD, X_PTR, Y_PTR, W_WORD = 0, 1, 2, 3, 4, 5
DONE, STATUS, BAD, TIMEOUT = 8, 9, 10, 11
# a GPU poster's stamps: this call's start (written before REQ), and the last finished call's start,
# post, answer seen and end (written together when it ends)
G_NOW, G_START, G_POSTED, G_SEEN, G_END = 6, 12, 13, 14, 15
CTRL_WORDS = CHANNEL_BASE + CHANNEL_WORDS * MAX_CHANNELS

# the leader's time counters (`ExpertPool.profile`): requests and tokens served, then cycles spent in
# each step of a request, added up (the leader's clock: a step that ends at a barrier ends when the
# slowest thread arrives)
P_REQUESTS, P_TOKENS, P_WAIT, P_SETUP, P_GU_OWN, P_GU, P_SWIGLU, P_DOWN_OWN, P_DOWN, P_TAIL = range(10)
PROF_STEPS = ("wait", "setup", "gate_up_own", "gate_up", "swiglu", "down_own", "down", "tail")
SERVED_STEPS = ("setup", "gate_up", "swiglu", "down", "tail")  # a request's serving, end to end
# token-layers served before seconds_per_token answers (fewer: the first calls' warm-up would weigh)
RATE_MIN_TOKENS = 256
# and the GPU's side, from the stamps kernels/expert_call.cu writes into its channel (nanoseconds of the
# GPU's clock, added up by the leader): calls counted, the kernel's start to its post, the post to the
# answer seen, the answer to the rows back, and one call's end to the next one's start on that channel
P_GPU_CALLS, P_GPU_POST, P_GPU_WAIT, P_GPU_READ, P_GPU_BETWEEN = range(10, 15)
GPU_STEPS = ("gpu_post", "gpu_wait", "gpu_read", "gpu_between")
PROF_WORDS = 16

# work stealing of the gate/up jobs: rows a thread takes at a time, and the int64 words between two
# threads' counters (one cache line each)
STEAL_ROWS = 32
STEAL_STRIDE = 8

DEFAULT_SPIN = 200_000  # polls before an idle thread naps (about a millisecond of spinning)
NAP_US = 50
NAPS_SHORT, NAPS_MEDIUM = 400, 1000

_njit = ce.njit
_HAVE = ce.HAVE_NUMBA


# ---- atomics on int64 words of an array (LLVM atomic loads, stores and adds) ---------------------------

def _word_pointer(context: Any, builder: Any, aty: Any, arr: Any, idx: Any) -> Any:
    ary = context.make_array(aty)(context, builder, arr)
    return ce._cgutils.get_item_pointer(context, builder, aty, ary, [idx])


@ce._intrinsic
def _load_acquire(typingctx, arr, idx):  # pragma: no cover - compiled
    from numba.core import types

    def codegen(context, builder, sig, args):
        ptr = _word_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, idx), codegen


@ce._intrinsic
def _store_release(typingctx, arr, idx, value):  # pragma: no cover - compiled
    from numba.core import types

    def codegen(context, builder, sig, args):
        ptr = _word_pointer(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, types.int64), codegen


@ce._intrinsic
def _fetch_add(typingctx, arr, idx, value):  # pragma: no cover - compiled
    from numba.core import types

    def codegen(context, builder, sig, args):
        ptr = _word_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "acq_rel")

    return types.int64(arr, idx, types.int64), codegen


@ce._intrinsic
def _f32_pointer(typingctx, addr):  # pragma: no cover - compiled
    from numba.core import types

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(types.float32)(types.int64), codegen


def _nap_function() -> Any:
    """A C function that sleeps about `us` microseconds (callable from compiled code): usleep, or
    Windows' Sleep in milliseconds (its shortest sleep is a millisecond or more)."""
    if sys.platform == "win32":
        fn = ctypes.windll.kernel32.Sleep  # type: ignore[attr-defined]
        fn.argtypes, fn.restype = [ctypes.c_uint32], None
        return fn, 1000
    fn = ctypes.CDLL(None).usleep
    fn.argtypes, fn.restype = [ctypes.c_uint32], ctypes.c_int
    return fn, 1


_NAP, _NAP_DIV = _nap_function()


@_njit(inline="always")
def _nap(idle, spin):  # pragma: no cover - compiled
    """Sleep after `idle` polls without a call, once past `spin`: 50 us naps for the first NAPS_SHORT,
    1 ms for the next NAPS_MEDIUM (about a second), then 5 ms (an idle pool's few hundred wake-ups a
    second; the first call after a long idle waits up to that long once)."""
    over = idle - spin
    if over > 0:
        us = NAP_US if over < NAPS_SHORT else (1000 if over < NAPS_SHORT + NAPS_MEDIUM else 5000)
        _NAP(np.uint32(max(1, us // _NAP_DIV)))


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@ce._intrinsic
def _relax(typingctx):  # pragma: no cover - compiled
    """A spin-wait hint (x86 `pause`: the waiting thread yields its core's pipeline to a hyperthread
    sibling, and a hypervisor sees a spinning virtual CPU); nothing elsewhere."""
    from numba.core import types

    def codegen(context, builder, sig, args):
        if _X86:
            fn = ce._declare(builder, "llvm.x86.sse2.pause", ce._ir.VoidType(), [])
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@ce._intrinsic
def _cycles(typingctx):  # pragma: no cover - compiled
    """The CPU's cycle counter (x86: the invariant TSC; `_cycle_seconds` calibrates it)."""
    from numba.core import types

    def codegen(context, builder, sig, args):
        fn = ce._declare(builder, "llvm.readcyclecounter", ce._ir.IntType(64), [])
        return builder.call(fn, [])

    return types.int64(), codegen


@_njit(nogil=True, cache=True)
def _cycles_now():  # pragma: no cover - compiled
    return _cycles()


_CYCLE_SECONDS: list[float] = []


def _cycle_seconds() -> float:
    """Seconds per count of `_cycles` (measured once against the monotonic clock over 20 ms; 0.0 where
    the counter does not move)."""
    if not _CYCLE_SECONDS:
        c0, t0 = _cycles_now(), time.perf_counter()
        time.sleep(0.02)
        c1, t1 = _cycles_now(), time.perf_counter()
        _CYCLE_SECONDS.append((t1 - t0) / (c1 - c0) if c1 > c0 else 0.0)
    return _CYCLE_SECONDS[0]


@_njit(inline="always")
def _lap(prof, word, t0):  # pragma: no cover - compiled
    """Add the cycles since t0 to prof[word]; returns now."""
    t = _cycles()
    prof[word] += t - t0
    return t


@_njit(inline="always")
def _gpu_stamps(ctrl, base, prof):  # pragma: no cover - compiled
    """At a request on the channel at `base`: add up the GPU's stamps of the channel's last finished
    call and the gap from its end to this call's start. A host poster writes no stamps (zeros: nothing
    added), and a set that is not in order (a call that timed out, a first call) is skipped."""
    now = _load_acquire(ctrl, base + G_NOW)
    start, posted = _load_acquire(ctrl, base + G_START), _load_acquire(ctrl, base + G_POSTED)
    seen, end = _load_acquire(ctrl, base + G_SEEN), _load_acquire(ctrl, base + G_END)
    if 0 < start <= posted <= seen <= end <= now:
        prof[P_GPU_CALLS] += 1
        prof[P_GPU_POST] += posted - start
        prof[P_GPU_WAIT] += seen - posted
        prof[P_GPU_READ] += end - seen
        prof[P_GPU_BETWEEN] += now - end


@_njit(inline="always")
def _barrier(ctrl, n):  # pragma: no cover - compiled
    """All n threads meet: the last to arrive resets the count, then moves the generation on."""
    g = _load_acquire(ctrl, BAR_GEN)
    if _fetch_add(ctrl, BAR_COUNT, 1) == n - 1:
        _store_release(ctrl, BAR_COUNT, 0)
        _store_release(ctrl, BAR_GEN, g + 1)
    else:  # a pure spin (no call, so the token shares that inline it stay cacheable): the pool has no
        # more threads than cores
        while _load_acquire(ctrl, BAR_GEN) == g:
            _relax()


@_njit(inline="always")
def _run_of(n, w, nthreads):  # pragma: no cover - compiled
    """Thread w's contiguous run [lo, hi) of n jobs split over nthreads."""
    return n * w // nthreads, n * (w + 1) // nthreads


@_njit(inline="always")
def _next_chunk(steal, word, w, n, stealing, n_jobs, chunk, v0):  # pragma: no cover - compiled
    """Thread w's next chunk [i0, i1) of n_jobs jobs split into n contiguous runs, each taken `chunk`
    jobs at a time through its counter (word `word` of the run's stride in `steal`): from its own
    run (v0 = 0) first, then, when `stealing`, from what is left of the others' in turn. Returns
    (i0, i1, the run it came from, to pass back as v0); i0 == i1 when nothing is left."""
    last = n if stealing else 1
    while v0 < last:
        v = w + v0 - (n if w + v0 >= n else 0)
        lo, hi = _run_of(n_jobs, v, n)
        i0 = lo + chunk * _fetch_add(steal, STEAL_STRIDE * v + word, 1)
        if i0 < hi:
            return i0, min(i0 + chunk, hi), v0
        v0 += 1
    return 0, 0, v0


def _named(fn: Callable, name: str, **options: Any) -> Any:
    """fn compiled under a name of its own: the pool's loop calls several of these factories' products,
    and numba names compiled functions by their Python names and argument types (two closures named
    alike were linked as one)."""
    fn.__name__ = fn.__qualname__ = name
    return _njit(nogil=True, cache=True, **options)(fn)


def _job_runs(t_g: int, t_u: int, t_d: int) -> tuple[Any, Any, Any]:
    """A thread's run of gate/up jobs [lo, hi) of one stack pair, of up jobs alone (two types), and its
    down-sum job, compiled without numba's reference counting: each job takes views of the expert rows,
    and counting them (an atomic add and subtract each) made a serial run of gate/up jobs 35% slower than
    the same jobs as a parallel loop's body, which numba compiles without it."""

    def gate_up(lo, hi, g_raw, u_raw, per, jobs, idx, xq, xd, xs, table, gu):  # pragma: no cover - compiled
        for i in range(lo, hi):
            ce._matvec_job(t_g, i, g_raw, u_raw, per, jobs, idx, xq, xd, xs, 0, table, gu)

    def up_only(lo, hi, g_raw, u_raw, per_u, jobs_u, idx, xq, xd, xs, table, gu):  # pragma: no cover - compiled
        for i in range(lo, hi):
            ce._matvec_job(t_u, per_u + i, g_raw, u_raw, per_u, jobs_u, idx, xq, xd, xs, 0, table, gu)

    def down(j, rows, d_raw, idx, w32, hq, hd, hs, table, out):  # pragma: no cover - compiled
        ce._down_sum_job(t_d, j, rows, d_raw, idx, w32, hq, hd, hs, table, out)

    tag = f"{t_g}_{t_u}_{t_d}"
    return (_named(gate_up, f"pool_gate_up_{tag}", _nrt=False), _named(up_only, f"pool_up_{tag}", _nrt=False),
            _named(down, f"pool_down_{tag}", _nrt=False))


def _token_share(t_g: int, t_u: int, t_d: int, mode: int) -> Any:
    """One thread's share of one token's routed experts, for these types and gate/up layout (the
    one-call kernel's steps, `cpu_experts._token_kernel`, with a barrier where each region ends):
    returns the first bad slot (nothing computed; every thread finds the same), else -1 with `out`
    written once all threads return.

    The gate/up jobs are split into contiguous runs, one a thread, taken STEAL_ROWS rows at a time
    through a counter per run (`steal`): a thread done with its own run takes the rest of the others'
    runs, so a thread the system holds up (a core shared with the posting process, an interrupt) no
    longer holds every other thread at the barrier (`steal` 0: each thread its own run only). Then
    SwiGLU and h's quantization a slot a thread, a barrier, and each thread's down-sum job. (Tried:
    every thread running SwiGLU of every slot into its own h, one barrier less: on the H200 host the
    step took 66-88 us a layer against 19, every thread reading every other's gate/up rows.)"""
    gate_up, up_only, down = _job_runs(t_g, t_u, t_d)

    def share(w, n, ctrl, steal, stealing, x, ids, wts, g_raw, u_raw, d_raw, fe, table, idx, w32, xq, xd, xs, gu, hq, hd,
              hs, out, prof):  # pragma: no cover - compiled
        lead = w == 0
        t = _cycles()
        k = ids.shape[0]
        bad = ce._token_nb(x, ids, wts, g_raw.shape[0], idx, w32, xq, xd, xs)
        if bad >= 0:
            return bad
        jobs, per = ce._matvec_jobs(t_g, g_raw.shape[1], k)
        n_gu = 2 * per if mode == ce._ONE_REGION else per
        chunk = max(1, STEAL_ROWS // ce._rows_per_job(t_g))
        i0, i1, v0 = _next_chunk(steal, 0, w, n, stealing, n_gu, chunk, 0)
        while i0 < i1:
            gate_up(i0, i1, g_raw, u_raw, per, jobs, idx, xq, xd, xs, table, gu)
            i0, i1, v0 = _next_chunk(steal, 0, w, n, stealing, n_gu, chunk, v0)
        if mode == ce._TWO_REGIONS:
            jobs_u, per_u = ce._matvec_jobs(t_u, u_raw.shape[1], k)
            chunk_u = max(1, STEAL_ROWS // ce._rows_per_job(t_u))
            i0, i1, v0 = _next_chunk(steal, 1, w, n, stealing, per_u, chunk_u, 0)
            while i0 < i1:
                up_only(i0, i1, g_raw, u_raw, per_u, jobs_u, idx, xq, xd, xs, table, gu)
                i0, i1, v0 = _next_chunk(steal, 1, w, n, stealing, per_u, chunk_u, v0)
        if lead:
            _lap(prof, P_GU_OWN, t)
        _barrier(ctrl, n)
        # no thread takes from these runs again before the next token's (two barriers later)
        _store_release(steal, STEAL_STRIDE * w, 0)
        _store_release(steal, STEAL_STRIDE * w + 1, 0)
        if lead:
            t = _lap(prof, P_GU, t)
        for s in range(w, k, n):  # a slot a thread
            if mode == ce._FUSED:
                ce._swiglu_quantize_nb(gu[:, s : s + 1], 0, fe, fe, hq[s : s + 1], hd[s : s + 1], hs[s : s + 1])
            else:
                ce._swiglu_quantize_nb(gu[:, s : s + 1], 1, 0, fe, hq[s : s + 1], hd[s : s + 1], hs[s : s + 1])
        _barrier(ctrl, n)
        if lead:
            t = _lap(prof, P_SWIGLU, t)
        rows, n_jobs = ce._down_jobs(d_raw.shape[1], n)
        if w < n_jobs:
            down(w, rows, d_raw, idx, w32, hq, hd, hs, table, out)
        if lead:
            _lap(prof, P_DOWN_OWN, t)
        _barrier(ctrl, n)  # out is whole; gu may be written again
        if lead:
            _lap(prof, P_DOWN, t)
        return -1

    return _named(share, f"pool_share_{t_g}_{t_u}_{t_d}_{mode}")


MAX_KINDS = 4  # (gate, up, down types, layout) combinations one pool serves
_SHARES: dict[tuple[int, int, int, int], Any] = {}
_WORKERS: dict[tuple[Any, ...], Any] = {}


def _share_for(kind: tuple[int, int, int, int]) -> Any:
    fn = _SHARES.get(kind)
    if fn is None:
        fn = _SHARES.setdefault(kind, _token_share(*kind))
    return fn


def _worker(kinds: tuple[tuple[int, int, int, int], ...]) -> Any:
    """The loop every pool thread runs for entries of these kinds (at most MAX_KINDS; each kind's
    token share is compiled for its types alone, as the one-call kernels are)."""
    key = tuple(kinds)
    fn = _WORKERS.get(key)
    if fn is not None:
        return fn
    padded = list(kinds) + [kinds[0]] * (MAX_KINDS - len(kinds))
    s0, s1, s2, s3 = (_share_for(k) for k in padded)

    @_njit(nogil=True, cache=False)
    def worker(w, n, gen, seen0, ctrl, prof, steal, stealing, n_channels, gates, ups, downs, table, table_f, gu, hq,
               hd, hs, k_max, h_max):  # pragma: no cover - compiled
        """table[e]: kind, fe, H of entry e; gates/ups/downs[e]: its stacks' blocks; table_f: the
        fp16 table; gen: JOB_GEN when the threads were started (every thread must begin from the same
        value: a thread that read it after the leader's first hand-over would wait for the next one);
        seen0: each channel's REQ then (a request left from before, one a GPU stopped waiting for, is
        not served: its words may be half rewritten by the next one; posters start the threads first);
        prof: the leader's time counters (P_*); steal: the gate/up runs' counters (stealing: whether
        threads take from each other's runs). Returns when STOP is set."""
        idx = np.empty(k_max, np.int64)
        w32 = np.empty(k_max, np.float32)
        # this thread's copy of a request's token (values, ids and weights, x's int8 blocks), at the
        # largest entry's sizes: each request uses the first H / k
        xv_all = np.empty(h_max, np.float32)
        iv_all = np.empty(k_max, np.float32)
        wv_all = np.empty(k_max, np.float32)
        xq_all = np.empty(h_max, np.int8)
        xd_all = np.empty(h_max // 32, np.float32)
        xs_all = np.empty(h_max // 32, np.int32)
        seen = seen0.copy()
        idle = 0
        t_done = 0
        while True:
            spin = _load_acquire(ctrl, SPIN)
            if w == 0:  # the leader finds a request and hands it to everyone
                found = -1
                while found < 0:
                    if _load_acquire(ctrl, STOP) != 0:
                        break
                    for c in range(n_channels):
                        r = _load_acquire(ctrl, CHANNEL_BASE + CHANNEL_WORDS * c + REQ)
                        if r != seen[c]:
                            found = c
                            seen[c] = r
                            break
                    if found < 0:
                        idle += 1
                        _relax()
                        _nap(idle, spin)
                if found < 0:
                    _store_release(ctrl, JOB_CH, -1)
                else:
                    _store_release(ctrl, JOB_CH, found)
                    _store_release(ctrl, JOB_SEQ, seen[found])
                gen += 1
                _store_release(ctrl, JOB_GEN, gen)
            else:
                while _load_acquire(ctrl, JOB_GEN) == gen:
                    idle += 1
                    _relax()
                    _nap(idle, spin)
                gen += 1
            idle = 0
            c = _load_acquire(ctrl, JOB_CH)
            if c < 0:
                return
            seq = _load_acquire(ctrl, JOB_SEQ)
            base = CHANNEL_BASE + CHANNEL_WORDS * c
            if w == 0:
                t_found = _cycles()
                if t_done:  # the time since the last answer: the posters' own work, or idle
                    prof[P_WAIT] += t_found - t_done
                _gpu_stamps(ctrl, base, prof)
            e = _load_acquire(ctrl, base + ENTRY)
            T = _load_acquire(ctrl, base + T_WORD)
            kind, fe, H = table[e, 0], table[e, 1], table[e, 2]
            W = _load_acquire(ctrl, base + W_WORD)
            k = (W - H) // 2  # the poster checked 1 <= k <= the entry's experts
            xrows = ce._numba.carray(_f32_pointer(_load_acquire(ctrl, base + X_PTR)), (T, W))
            yrows = ce._numba.carray(_f32_pointer(_load_acquire(ctrl, base + Y_PTR)), (T, H))
            g_raw, u_raw, d_raw = gates[e], ups[e], downs[e]
            xv, iv, wv = xv_all[:H].reshape((1, H)), iv_all[:k], wv_all[:k]
            id_bits = iv.view(np.int32)
            xq, xd = xq_all[:H].reshape((1, H)), xd_all[: H // 32].reshape((1, H // 32))
            xs = xs_all[: H // 32].reshape((1, H // 32))
            ik, wk = idx[:k], w32[:k]
            if w == 0:
                prof[P_SETUP] += _cycles() - t_found
            for t in range(T):
                for j in range(H):
                    xv[0, j] = xrows[t, j]
                for s in range(k):
                    iv[s] = xrows[t, H + s]
                    wv[s] = xrows[t, H + k + s]
                out = yrows[t]
                if kind == 0:
                    bad = s0(w, n, ctrl, steal, stealing, xv, iv, wv, g_raw, u_raw, d_raw, fe, table_f, ik, wk, xq, xd,
                             xs, gu, hq, hd, hs, out, prof)
                elif kind == 1:
                    bad = s1(w, n, ctrl, steal, stealing, xv, iv, wv, g_raw, u_raw, d_raw, fe, table_f, ik, wk, xq, xd,
                             xs, gu, hq, hd, hs, out, prof)
                elif kind == 2:
                    bad = s2(w, n, ctrl, steal, stealing, xv, iv, wv, g_raw, u_raw, d_raw, fe, table_f, ik, wk, xq, xd,
                             xs, gu, hq, hd, hs, out, prof)
                else:
                    bad = s3(w, n, ctrl, steal, stealing, xv, iv, wv, g_raw, u_raw, d_raw, fe, table_f, ik, wk, xq, xd,
                             xs, gu, hq, hd, hs, out, prof)
                if bad >= 0 and w == 0:
                    for j in range(H):
                        out[j] = np.nan
                    if _load_acquire(ctrl, base + STATUS) == 0:
                        _store_release(ctrl, base + BAD, np.int64(id_bits[bad]))
                        _store_release(ctrl, base + STATUS, bad + 1)
            # every thread has passed the last token's final barrier (or found the same bad slot): the
            # rows are whole
            if w == 0:
                t_tail = _cycles()
                _store_release(ctrl, base + DONE, seq)
                t_done = _cycles()
                prof[P_TAIL] += t_done - t_tail
                prof[P_REQUESTS] += 1
                prof[P_TOKENS] += T

    _WORKERS[key] = worker
    return worker


@dataclass(frozen=True)
class _Entry:
    gate: ce.ExpertStack
    up: ce.ExpertStack | None
    down: ce.ExpertStack
    kind: tuple[int, int, int, int]
    fe: int

    def check_rows(self, x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> None:
        """Raise ValueError unless rows x (T, H + 2k), 1 <= k <= the experts, and y (T, H) fit."""
        H, E = self.gate.n_in, self.gate.n_experts
        T = x_shape[0] if len(x_shape) == 2 else -1
        k2 = x_shape[1] - H if len(x_shape) == 2 else -1
        if T < 0 or k2 < 2 or k2 % 2 or k2 // 2 > E or tuple(y_shape) != (T, H):
            raise ValueError(f"rows {x_shape} -> {y_shape} do not fit a layer of hidden size {H} and {E} "
                             "experts (T, hidden + 2k) -> (T, hidden)")


class ExpertChannel:
    """One poster's (a GPU's) slot in the pool's control block. `post` is the host's way to post
    (tests, and any caller without a GPU kernel); a GPU posts with kernels/expert_call.cu, given
    `word_address`."""

    timeout_s = 120.0  # how long a GPU waits for an answer before its rows turn NaN (TIMEOUT)

    def __init__(self, pool: ExpertPool, index: int):
        self.pool = pool
        self.word = CHANNEL_BASE + CHANNEL_WORDS * index  # first word of this channel in ctrl

    @property
    def posted(self) -> int:
        """The number of the last request posted on this channel (a poster's next is one more)."""
        return int(self.pool.ctrl[self.word + REQ])

    @property
    def answered(self) -> int:
        """The number of the last request the pool answered on this channel."""
        return int(self.pool.ctrl[self.word + DONE])

    @property
    def word_address(self) -> int:
        """Host address of the channel's first word (page-locked: a GPU reaches it by this address)."""
        return int(self.pool.ctrl.ctypes.data) + 8 * self.word

    def post(self, entry: int, x: np.ndarray, y: np.ndarray, timeout: float = 60.0) -> None:
        """Run entry `entry` on the rows x (T, H + 2k) float32 into y (T, H) float32, both C-contiguous
        and kept alive by the caller, and wait for it; raise what `check` raises."""
        e = self.pool.entry(entry)
        T = int(x.shape[0])
        if x.dtype != np.float32 or y.dtype != np.float32 or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise ValueError("rows must be C-contiguous float32")
        e.check_rows(x.shape, y.shape)
        self.pool.ensure_running()
        ctrl, w = self.pool.ctrl, self.word
        seq = self.posted + 1
        ctrl[w + ENTRY], ctrl[w + T_WORD] = entry, T
        ctrl[w + X_PTR], ctrl[w + Y_PTR], ctrl[w + W_WORD] = x.ctypes.data, y.ctypes.data, x.shape[1]
        ctrl[w + REQ] = seq  # last (x86 keeps stores in order; the pool's acquire pairs with it)
        end = time.monotonic() + timeout
        while int(ctrl[w + DONE]) != seq:
            if time.monotonic() > end:
                raise TimeoutError(f"the expert pool did not answer within {timeout:g} s")
            if not self.pool.running:
                raise RuntimeError("the expert pool stopped while a call was waiting")
            time.sleep(0)
        self.check()

    def check(self) -> None:
        """Raise (once) what the pool or the GPU reported on this channel since the last check."""
        ctrl, w = self.pool.ctrl, self.word
        status, timed_out = int(ctrl[w + STATUS]), int(ctrl[w + TIMEOUT])
        if not status and not timed_out:
            return
        bad = np.array([ctrl[w + BAD]], np.int64).astype(np.int32).view(np.float32)[0]
        ctrl[w + STATUS] = ctrl[w + TIMEOUT] = 0
        if timed_out:
            raise RuntimeError("routed experts on the host did not answer in time (the GPU stopped "
                               "waiting for the expert pool; its rows are NaN)")
        raise IndexError(f"expert id {bad!r} (slot {status - 1}) is not one of the layer's experts")


class ExpertPool:
    """Threads (`threads` of them) that serve routed-expert calls posted into `ctrl`.

    alloc(shape, dtype) makes the control block (a GPU backend's `pinned_empty`: page-locked memory
    its kernels can write; plain NumPy memory serves host posters). Entries (a layer's stacks; k comes
    with each call) are added with add_entry; channels with channel(). The threads start on `ensure_running` and stop
    on `stop` / `close`."""

    def __init__(self, threads: int, alloc: Callable[[tuple[int, ...], str], Any] | None = None):
        if not _HAVE:
            raise RuntimeError("the expert pool needs numba (`pip install numba`)")
        # no more threads than cores: a thread that waits at a barrier spins
        self.threads = max(1, min(int(threads), usable_cores()))
        ctrl = (alloc or (lambda shape, dtype: np.empty(shape, dtype)))((CTRL_WORDS,), "int64")
        ctrl[...] = 0
        ctrl[SPIN] = DEFAULT_SPIN
        self.ctrl: np.ndarray = ctrl
        self.prof = np.zeros(PROF_WORDS, np.int64)  # the leader's counters (`profile`)
        # threads take the rest of each other's gate/up runs (MINECART_EXPERT_POOL_STEAL=0: each its own
        # run only, the form before; for comparisons)
        self.stealing = os.environ.get("MINECART_EXPERT_POOL_STEAL", "1") != "0"
        self._entries: dict[int, _Entry] = {}
        self._next_entry = 0
        self._channels: list[ExpertChannel] = []
        self._free: list[ExpertChannel] = []
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    # ---- what it serves ----------------------------------------------------------------------------
    def add_entry(self, gate: ce.ExpertStack, up: ce.ExpertStack | None, down: ce.ExpertStack) -> int:
        """Register one layer's stacks (stopping the threads: register before posting); returns its
        entry number (what a post names)."""
        fe = ce._check_block(gate, up, down, gate.n_in)
        u = gate if up is None else up
        kind = (gate.ggml_type, u.ggml_type, down.ggml_type, ce._gate_up_mode(gate, up))
        kinds = {e.kind for e in self._entries.values()} | {kind}
        if len(kinds) > MAX_KINDS:
            raise ValueError(f"one expert pool serves at most {MAX_KINDS} combinations of expert types")
        with self._lock:
            self.stop()
            n = self._next_entry
            self._next_entry += 1
            self._entries[n] = _Entry(gate, up, down, kind, fe)
        return n

    def drop_entries(self, entries: list[int]) -> None:
        with self._lock:
            self.stop()
            for e in entries:
                self._entries.pop(e, None)

    def entry(self, n: int) -> _Entry:
        return self._entries[n]

    def channel(self) -> ExpertChannel:
        """A channel of its own for one poster (a free one again after `release_channel`)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self._channels) >= MAX_CHANNELS:
                raise RuntimeError(f"an expert pool has at most {MAX_CHANNELS} channels")
            self.stop()
            ch = ExpertChannel(self, len(self._channels))
            self._channels.append(ch)
            return ch

    def release_channel(self, channel: ExpertChannel) -> None:
        """Give a channel back (its poster is gone; the next `channel()` may hand it out again)."""
        with self._lock:
            if channel in self._channels and channel not in self._free:
                self._free.append(channel)

    # ---- the threads -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def ensure_running(self) -> None:
        """Start the threads if they are not up (cheap when they are)."""
        if self.running:
            return
        with self._lock:
            if self._errors:
                exc = self._errors[0]
                raise RuntimeError(f"the expert pool's threads failed: {exc}") from exc
            if self.running:  # another poster started them meanwhile
                return
            self.stop()
            if not self._entries or not self._channels:
                raise RuntimeError("the expert pool has no entries or no channels to serve")
            self._start()

    def _start(self) -> None:
        ids = sorted(self._entries)
        n_rows = max(ids) + 1
        kinds = sorted({e.kind for e in self._entries.values()})
        worker = _worker(tuple(kinds))
        from numba.typed import List

        first = self._entries[ids[0]]
        gates, ups, downs = List(), List(), List()
        table = np.zeros((n_rows, 3), np.int64)
        for n in range(n_rows):
            e = self._entries.get(n, first)  # a dropped entry's row: any stacks (never posted to)
            gates.append(e.gate.raw)
            ups.append((e.gate if e.up is None else e.up).raw)
            downs.append(e.down.raw)
            table[n] = (kinds.index(e.kind), e.fe, e.gate.n_in)
        es = list(self._entries.values())
        k_max = max(e.gate.n_experts for e in es)  # k is the poster's (W = H + 2k), at most every expert
        rows_max = max(e.gate.n_out for e in es)
        fe_max = max(e.fe for e in es)
        h_max = max(e.gate.n_in for e in es)
        n = self.threads
        gu = np.empty((2, k_max, rows_max), np.float32)
        hq = np.empty((k_max, fe_max), np.int8)
        hd = np.empty((k_max, fe_max // 32), np.float32)
        hs = np.empty((k_max, fe_max // 32), np.int32)
        steal = np.zeros(STEAL_STRIDE * n, np.int64)
        ctrl = self.ctrl
        args = (ctrl, self.prof, steal, self.stealing, len(self._channels), gates, ups, downs, table, ce._F16_TABLE, gu, hq, hd,
                hs, k_max, h_max)
        # compiled here, in the caller's thread (a first start compiles for seconds, which a GPU waiting
        # for its first answer should not wait through): with STOP set the loop returns at once
        seen = np.array([ctrl[c.word + REQ] for c in self._channels], np.int64)
        _cycle_seconds()  # calibrated now, not when a profile is read between calls
        ctrl[STOP] = 1
        worker(0, n, int(ctrl[JOB_GEN]), seen, *args)
        ctrl[STOP] = 0
        ctrl[BAR_COUNT] = 0
        gen = int(ctrl[JOB_GEN])

        def run(w: int) -> None:
            try:
                worker(w, n, gen, seen, *args)
            except BaseException as exc:  # noqa: BLE001 - reported by ensure_running
                self._errors.append(exc)

        self._threads = [threading.Thread(target=run, args=(w,), name=f"minecart-experts-{w}", daemon=True)
                         for w in range(n)]
        for t in self._threads:
            t.start()

    def profile(self) -> dict[str, float]:
        """The leader's counters since the pool was made: "requests" and "tokens" served, then seconds
        spent in each step of a request (PROF_STEPS): "wait" between one answer and the next request
        (the posters' own work between calls, or idle), "setup" (the hand-over and the rows' copy),
        "gate_up" up to the barrier after the gate/up jobs ("gate_up_own": the leader's own run of
        them; the difference is the wait for the slowest thread), "swiglu", "down" ("down_own"), and
        "tail" (the answer). A GPU poster's calls (kernels/expert_call.cu's stamps, its own clock) add
        "gpu_calls" and the seconds of GPU_STEPS: "gpu_post" (the kernel's start to its request written),
        "gpu_wait" (to the answer seen), "gpu_read" (to the rows back) and "gpu_between" (one call's end
        to the channel's next call's start: the GPU's work between). Subtract two readings to time a
        stretch of calls."""
        p = self.prof.copy()
        sec = _cycle_seconds()
        out = {"requests": float(p[P_REQUESTS]), "tokens": float(p[P_TOKENS]), "gpu_calls": float(p[P_GPU_CALLS])}
        for i, name in enumerate(PROF_STEPS):
            out[name] = float(p[P_WAIT + i]) * sec
        for i, name in enumerate(GPU_STEPS):
            out[name] = float(p[P_GPU_POST + i]) * 1e-9
        return out

    def seconds_per_token(self) -> float | None:
        """Seconds the pool has taken to serve one token of one layer's experts, over everything it
        served since it was made (the SERVED_STEPS of `profile`, not the waits between requests);
        None before RATE_MIN_TOKENS token-layers. The machine's own rate, where the planner has one
        figure for every CPU (placement.host_expert_seconds)."""
        p = self.profile()
        if p["tokens"] < RATE_MIN_TOKENS:
            return None
        return sum(p[s] for s in SERVED_STEPS) / p["tokens"]

    def stop(self) -> None:
        """Stop the threads (between calls: a request in flight is finished first)."""
        if not self._threads:
            return
        self.ctrl[STOP] = 1
        for t in self._threads:
            t.join()
        self._threads = []

    def close(self) -> None:
        with self._lock:
            self.stop()


_POOLS: dict[int, ExpertPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(threads: int, alloc: Callable[[tuple[int, ...], str], Any]) -> ExpertPool:
    """The process's pool of `threads` threads, made on first use with `alloc` (every GPU of a rig posts
    into the same one: page-locked memory is reachable from every device by one address, and two pools
    would fight for the cores)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(int(threads))
        if pool is None:
            if not _POOLS:
                # the threads stop before the interpreter (and the library whose page-locked memory they
                # read) is torn down: atexit runs the handlers registered last first
                atexit.register(_stop_all)
            pool = _POOLS[int(threads)] = ExpertPool(threads, alloc)
        return pool


def _stop_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
