"""The expert pool (engine/expert_pool.py): threads that stay up and serve routed-expert calls posted into
shared memory. Here the host posts (ExpertChannel.post: what the GPU kernel, kernels/expert_call.cu,
writes, written by Python); tests/gpu/test_moe_gpu.py posts from the GPU.

The pool splits a token's work over its threads with barriers in between; every row must still be what
the one-call kernel (`cpu_experts.routed_experts`, itself checked bit for bit against the NumPy twins in
test_cpu_experts.py) gives, to the bit, whatever the thread count, the entry or the k of a request."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from minecart.engine import cpu_experts as C
from minecart.engine import expert_pool as P
from minecart.engine import quants as Q

from tests.engine.test_cpu_experts import _block, random_stack

pytestmark = pytest.mark.skipif(not C.HAVE_NUMBA, reason="numba is not installed")

H, FE, E = 256, 96, 9


def _rows(rng, T, k, bad=None):
    """T tokens' rows (T, H + 2k): values, k distinct expert ids (as float32, as a GPU sends them),
    weights."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    if bad is not None:
        ids[bad] = bad[1] + E  # not an expert's id
    return np.ascontiguousarray(np.concatenate([x, ids, w], 1))


def _want(rows, k, stacks):
    out = np.empty((rows.shape[0], H), np.float32)
    for t, r in enumerate(rows):
        out[t] = C.routed_experts(r[:H], r[H : H + k], r[H + k :], *stacks)
    return out


def _bits(a):
    return np.ascontiguousarray(a).view(np.int32)


@pytest.fixture(scope="module")
def blocks():
    rng = np.random.default_rng(21)
    layouts = {name: _block(rng, name, E=E, H=H, Fe=FE) for name in ("separate", "same-type", "fused")}
    # a Q8_0 file's layout: fused gate+up and down both Q8_0
    layouts["q8_0"] = (random_stack(rng, Q.Q8_0, E, 2 * FE, H), None, random_stack(rng, Q.Q8_0, E, H, FE))
    return layouts


@pytest.mark.parametrize("threads, stealing", [(1, True), (2, True), (3, True), (3, False)])
def test_pool_rows_equal_the_one_call_kernel_bit_for_bit(blocks, threads, stealing):
    """Four kinds of entries in one pool (the most it serves), requests of 1-4 tokens and k of 1, 2, 3
    and 8 (k comes with each request): every row equals routed_experts' to the bit, with the threads
    taking from each other's gate/up runs or not."""
    rng = np.random.default_rng(threads)
    pool = P.ExpertPool(threads)
    pool.stealing = stealing
    try:
        entries = {name: pool.add_entry(*stacks) for name, stacks in blocks.items()}
        ch = pool.channel()
        for name, e in entries.items():
            for T, k in ((1, 3), (4, 2), (2, 8), (3, 1)):
                rows = _rows(rng, T, k)
                y = np.full((T, H), np.nan, np.float32)
                ch.post(e, rows, y)
                np.testing.assert_array_equal(_bits(y), _bits(_want(rows, k, blocks[name])), err_msg=f"{name} T={T} k={k}")
        assert ch.answered == 16
    finally:
        pool.close()


def test_two_channels_posting_at_once_each_get_their_own_rows(blocks):
    """Two posters (two GPUs of a rig) posting from two threads at the same time: the leader hands each
    request to every thread in turn, and each poster gets its own rows."""
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["separate"])
        chans = [pool.channel(), pool.channel()]
        errors: list[BaseException] = []

        def post_many(i: int) -> None:
            rng = np.random.default_rng(100 + i)
            try:
                for _ in range(15):
                    rows = _rows(rng, 2, 3)
                    y = np.empty((2, H), np.float32)
                    chans[i].post(e, rows, y)
                    np.testing.assert_array_equal(_bits(y), _bits(_want(rows, 3, blocks["separate"])))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        posters = [threading.Thread(target=post_many, args=(i,)) for i in range(2)]
        for t in posters:
            t.start()
        for t in posters:
            t.join(120)
        assert not errors, errors
        assert [c.answered for c in chans] == [15, 15]
    finally:
        pool.close()


def test_the_leaders_time_counters_account_for_the_calls(blocks):
    """`profile`: requests and tokens counted as posted; the steps' seconds are >= 0, a step that ends
    at a barrier takes at least the leader's own run of it, and the steps of a request (setup to tail)
    add up to no more than the posters' wall time around the calls, nor much less than the pool's own
    serving of them (the rest is the wait between calls)."""
    rng = np.random.default_rng(5)
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["fused"])
        ch = pool.channel()
        ch.post(e, _rows(rng, 1, 2), np.empty((1, H), np.float32))  # starts and compiles
        before = pool.profile()
        t0 = time.perf_counter()
        for T in (1, 3, 2, 1):
            ch.post(e, _rows(rng, T, 4), np.empty((T, H), np.float32))
        wall = time.perf_counter() - t0
        after = pool.profile()
        d = {key: after[key] - before[key] for key in after}
        assert d["requests"] == 4 and d["tokens"] == 7
        assert all(d[name] >= 0 for name in P.PROF_STEPS)
        assert d["gate_up"] >= d["gate_up_own"] > 0 and d["down"] >= d["down_own"] > 0
        served = sum(d[name] for name in P.SERVED_STEPS)
        assert 0 < served <= wall
        assert d["wait"] > 0  # the poster's Python between one answer and its next post
    finally:
        pool.close()


def test_the_pools_rate_is_its_serving_seconds_over_its_tokens(blocks):
    """seconds_per_token: None until RATE_MIN_TOKENS token-layers are served, then the serving steps'
    seconds (not the waits between requests) over the tokens."""
    rng = np.random.default_rng(8)
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["fused"])
        ch = pool.channel()
        T = 32
        for _ in range(P.RATE_MIN_TOKENS // T - 1):
            ch.post(e, _rows(rng, T, 2), np.empty((T, H), np.float32))
            assert pool.seconds_per_token() is None
        ch.post(e, _rows(rng, T, 2), np.empty((T, H), np.float32))
        time.sleep(0.05)  # the leader's last lap (the answer) is added as it leaves
        rate, p = pool.seconds_per_token(), pool.profile()
        assert p["tokens"] == P.RATE_MIN_TOKENS and p["wait"] > 0
        assert rate is not None and rate == pytest.approx(sum(p[k] for k in P.SERVED_STEPS) / p["tokens"])
        assert 0 < rate * p["tokens"] < sum(p[k] for k in ("wait",) + P.SERVED_STEPS)
    finally:
        pool.close()


def test_the_gpus_stamps_are_added_up_per_call(blocks):
    """A GPU poster's kernel writes its start with each request and, as the call ends, its start, post,
    answer seen and rows back; here the host writes the same words around its posts. At each request
    the leader adds up the last finished call's steps and the gap from its end to this call's start,
    and skips calls without stamps."""
    rng = np.random.default_rng(6)
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["separate"])
        ch = pool.channel()
        w = ch.word
        ch.post(e, _rows(rng, 1, 2), np.empty((1, H), np.float32))  # no stamps: nothing added
        before = pool.profile()
        for i in range(1, 5):
            start = 1000 * i + 10
            pool.ctrl[w + P.G_NOW] = start
            ch.post(e, _rows(rng, 1, 2), np.empty((1, H), np.float32))
            pool.ctrl[w + P.G_START : w + P.G_END + 1] = start, start + 1, start + 6, start + 8
        after = pool.profile()
        d = {key: after[key] - before[key] for key in after}
        assert d["gpu_calls"] == 3  # the 4th call's end is added when a 5th comes
        assert d["gpu_post"] == pytest.approx(3e-9) and d["gpu_wait"] == pytest.approx(15e-9)
        assert d["gpu_read"] == pytest.approx(6e-9) and d["gpu_between"] == pytest.approx(3 * 992e-9)
    finally:
        pool.close()


def test_an_id_that_is_not_an_experts_gives_a_nan_row_and_a_clear_error(blocks):
    """Token 1's slot 2 names expert E + 2: its row is NaN, the other tokens' rows are right, the error
    names the slot and the id once, and the next call is clean."""
    rng = np.random.default_rng(5)
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["fused"])
        ch = pool.channel()
        rows = _rows(rng, 3, 4, bad=(1, 2))
        y = np.zeros((3, H), np.float32)
        with pytest.raises(IndexError, match=r"expert id .*11\.0.*slot 2"):
            ch.post(e, rows, y)
        assert np.isnan(y[1]).all()
        good = rows[[0, 2]]
        np.testing.assert_array_equal(_bits(y[[0, 2]]), _bits(_want(good, 4, blocks["fused"])))
        ch.check()  # reported once
        rows = _rows(rng, 1, 4)
        ch.post(e, rows, y[:1])
        np.testing.assert_array_equal(_bits(y[:1]), _bits(_want(rows, 4, blocks["fused"])))
    finally:
        pool.close()


def test_rows_that_do_not_fit_an_entry_are_refused(blocks):
    pool = P.ExpertPool(1)
    try:
        e = pool.add_entry(*blocks["fused"])
        ch = pool.channel()
        y = np.zeros((1, H), np.float32)
        for x_shape in [(1, H + 1), (1, H), (1, H + 2 * (E + 1))]:  # odd, k = 0, k > E
            with pytest.raises(ValueError, match="do not fit"):
                ch.post(e, np.zeros(x_shape, np.float32), y)
        with pytest.raises(ValueError, match="do not fit"):
            ch.post(e, np.zeros((2, H + 4), np.float32), y)  # 2 tokens, 1 output row
        with pytest.raises(ValueError, match="float32"):
            ch.post(e, np.zeros((1, H + 4), np.float64), y)
        assert ch.answered == 0 and not pool.running  # nothing was posted, no thread started
    finally:
        pool.close()


def test_threads_start_on_demand_stop_for_new_entries_and_channels_come_back(blocks):
    rng = np.random.default_rng(9)
    pool = P.ExpertPool(2)
    try:
        a = pool.add_entry(*blocks["same-type"])
        ch = pool.channel()
        assert not pool.running
        rows, y = _rows(rng, 1, 2), np.empty((1, H), np.float32)
        ch.post(a, rows, y)
        assert pool.running
        b = pool.add_entry(*blocks["separate"])  # a new table: the threads stop, the next post starts them
        assert not pool.running
        ch.post(b, rows, y)
        np.testing.assert_array_equal(_bits(y), _bits(_want(rows, 2, blocks["separate"])))
        pool.drop_entries([a])
        with pytest.raises(KeyError):
            ch.post(a, rows, y)
        more = [pool.channel() for _ in range(P.MAX_CHANNELS - 1)]
        with pytest.raises(RuntimeError, match="at most"):
            pool.channel()
        pool.release_channel(more[3])
        again = pool.channel()
        assert again is more[3]
        again.post(b, rows, y)  # a channel handed out again answers from its own count on
        assert again.answered == 1
        pool.close()
        assert not pool.running
    finally:
        pool.close()


def test_idle_threads_nap_instead_of_spinning(blocks):
    """After SPIN polls without a call the threads nap between polls (50 us, then 1 ms, then 5 ms): the
    process's CPU time over an idle half second is a small part of what spinning threads would burn
    (2 threads x 0.5 s), and a call after the naps is still answered."""
    rng = np.random.default_rng(13)
    pool = P.ExpertPool(2)
    try:
        e = pool.add_entry(*blocks["fused"])
        ch = pool.channel()
        rows, y = _rows(rng, 1, 3), np.empty((1, H), np.float32)
        ch.post(e, rows, y)
        pool.ctrl[P.SPIN] = 1000  # nap almost at once
        time.sleep(0.1)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(0.5)
        used, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert used < 0.25 * wall, (used, wall)
        pool.ctrl[P.SPIN] = P.DEFAULT_SPIN
        ch.post(e, rows, y)
        np.testing.assert_array_equal(_bits(y), _bits(_want(rows, 3, blocks["fused"])))
    finally:
        pool.close()


@pytest.fixture(scope="module")
def fused_moe(tmp_path_factory):
    from tests._moe import tiny_moe_file

    return tiny_moe_file(tmp_path_factory, "fused")  # Q8_0 experts: the integer kernels take them


def test_a_layer_device_gets_the_same_rows_from_the_pool_as_from_a_host_function(fused_moe):
    """ExpertsApart on a layer device that pins host memory (as a GPU does; here a NumPy backend told
    so) posts each MoE layer's rows to the pool. The prefill and four decode steps give the same logits,
    to the bit, as the same model running the experts through a host function (use_pool off), and the
    pool answers once per MoE layer and token."""
    from minecart.engine.experts import ExpertsApart
    from minecart.engine.model import load_model

    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 640, size=9)]
    runs = {}
    for use_pool in (True, False):
        with load_model(fused_moe, devices=["cpu:0"], experts="cpu:1") as model:
            proxy = model.backends["layer.0"]
            assert isinstance(proxy, ExpertsApart)
            proxy.use_pool = use_pool
            proxy.inner.pins_host_memory = True  # the GPU's condition for the pool (and one-by-one tokens)
            n_moe = sum(1 for p in model.device_plan if p.endswith(".experts"))
            s = model.new_session(64)
            logits = [s.prefill(prompt)]
            calls = proxy.host_moe_calls
            for _ in range(4):
                logits.append(s.step(int(np.argmax(logits[-1]))))
            assert proxy.host_moe_calls - calls == 4 * n_moe
            assert (proxy._channel is not None) == use_pool
            s.close()
            runs[use_pool] = np.stack(logits)
    np.testing.assert_array_equal(_bits(runs[True]), _bits(runs[False]))


def test_a_simulated_link_charges_the_pools_calls_as_it_charges_host_functions(fused_moe):
    """A rig device's link pays for each MoE layer's rows going to the pool and back exactly what it
    pays for a host function's round trip (engine/rig.py), and the step's logits are the same bits."""
    from minecart.engine.model import load_model
    from minecart.engine.rig import Rig, RigBackend

    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 640, size=7)]
    runs = {}
    for use_pool in (True, False):
        with load_model(fused_moe, devices=Rig.cpus(1, link="100MB/s"), experts="cpu:1") as model:
            proxy = model.backends["layer.0"]
            rig = proxy.inner
            assert isinstance(rig, RigBackend)
            proxy.use_pool = use_pool
            rig.inner.pins_host_memory = True  # as a GPU's backend
            s = model.new_session(32)
            logits = s.prefill(prompt)
            before = rig.transferred_bytes, rig.transfer_seconds
            step = s.step(int(np.argmax(logits)))
            runs[use_pool] = (step, rig.transferred_bytes - before[0], rig.transfer_seconds - before[1],
                              proxy._channel is not None)
            s.close()
    (a, bytes_a, sec_a, pooled), (b, bytes_b, sec_b, hosted) = runs[True], runs[False]
    assert pooled and not hosted
    assert bytes_a == bytes_b > 0 and sec_a == pytest.approx(sec_b)
    np.testing.assert_array_equal(_bits(a), _bits(b))
