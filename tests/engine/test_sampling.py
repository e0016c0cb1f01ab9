"""Sampler: greedy, seeds, top-k / top-p / min-p supports, frequencies, penalties, parameter checks."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    filtered_probs,
    greedy_params,
    kept_tokens,
)

LOGITS = np.log(np.array([0.05, 0.5, 0.15, 0.3], dtype=np.float64)).astype(np.float32)  # p known


def _draws(params, logits=LOGITS, n=2000):
    s = Sampler(params)
    return np.array([s.pick(logits) for _ in range(n)])


def test_greedy_is_argmax_with_lowest_id_on_ties():
    s = Sampler(greedy_params())
    assert s(LOGITS) == 1
    assert s(np.array([0.0, 2.0, 2.0, 1.0], np.float32)) == 1
    assert s.generated == [1, 1]


def test_seed_reproducible_and_seeds_differ():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=123)
    a, b = _draws(p, n=200), _draws(p, n=200)
    np.testing.assert_array_equal(a, b)
    c = _draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=124), n=200)
    assert (a != c).any()


def test_frequencies_follow_the_distribution():
    draws = _draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1), n=6000)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.05, 0.5, 0.15, 0.3], atol=0.025)
    # temperature 0.5 squares and renormalizes the probabilities
    p = filtered_probs(LOGITS, SamplingParams(temperature=0.5, top_k=0, top_p=1.0))
    q = np.array([0.05, 0.5, 0.15, 0.3]) ** 2
    np.testing.assert_allclose(p, q / q.sum(), rtol=1e-6)


def test_filter_supports():
    base = dict(temperature=1.0, seed=0)
    assert set(_draws(SamplingParams(top_k=1, top_p=1.0, **base), n=300)) == {1}
    assert set(_draws(SamplingParams(top_k=2, top_p=1.0, **base))) == {1, 3}
    # top_p: 0.5 + 0.3 reaches 0.8 -> {1, 3}; 0.81 needs the 0.15 token too
    assert set(_draws(SamplingParams(top_k=0, top_p=0.8, **base))) == {1, 3}
    assert set(_draws(SamplingParams(top_k=0, top_p=0.81, **base))) == {1, 2, 3}
    # min_p 0.25 keeps p >= 0.125 -> {1, 2, 3}; 0.35 keeps p >= 0.175 -> {1, 3}
    assert set(_draws(SamplingParams(top_k=0, top_p=1.0, min_p=0.25, **base))) == {1, 2, 3}
    assert set(_draws(SamplingParams(top_k=0, top_p=1.0, min_p=0.35, **base))) == {1, 3}
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=1.0))
    np.testing.assert_allclose(p, np.array([0, 0.5, 0.15, 0.3]) / 0.95, rtol=1e-6)


def test_penalties():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], generated_ids=[1])
    np.testing.assert_allclose(rep, [1.0, -2.0, 0.5, 3.0, 1.0])
    pf = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                         prompt_ids=[4], generated_ids=[3, 3, 2])
    np.testing.assert_allclose(pf, [2.0, -1.0, 0.5 - 0.75, 3.0 - 1.0, 1.0])
    # a strong presence penalty moves greedy off a generated token
    s = Sampler(greedy_params(presence_penalty=5.0))
    assert s(logits) == 3
    assert s(logits) == 0


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0),
                                 dict(top_k=-1), dict(repetition_penalty=0.0), dict(max_tokens=-1)])
def test_invalid_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_stop_string_normalization():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["", "x"], stop_token_ids=[np.int64(5)]).stop_token_ids == (5,)


def test_inverse_cdf_matches_a_full_prefix_sum():
    from minecart.engine.sampling import _inverse_cdf

    rng = np.random.default_rng(5)
    w = rng.random(5000).astype(np.float32) ** 4
    cdf = np.cumsum(w, dtype=np.float64)
    for u in rng.random(500):
        want = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), w.size - 1)
        assert _inverse_cdf(w, u, block=64) == want


@pytest.mark.parametrize("top_k", [0, 3000])
def test_top_p_on_a_wide_flat_distribution(top_k):
    """Top-p needs most of a 5000-token vocabulary here (the partial sort must widen); the kept set
    equals a brute-force sort."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 0.3, 5000).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=0.9)
    ids, p = kept_tokens(logits, params)
    z = logits.astype(np.float64) / 1.3
    pool = np.arange(5000) if not top_k else np.argsort(-z, kind="stable")[:top_k]
    q = np.exp(z[pool] - z[pool].max())
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    n_keep = int(np.searchsorted(np.cumsum(q[order]), 0.9)) + 1
    assert n_keep > 1024
    np.testing.assert_array_equal(np.sort(ids), np.sort(pool[order[:n_keep]]))
    np.testing.assert_allclose(p.sum(), 1.0)


def test_candidates_needed():
    """How many top logits decide a pick: greedy 1, top-k k (up to TOP_CANDIDATES_MAX), whole rows
    for penalties and for top-k off or above the limit."""
    from minecart.engine.sampling import TOP_CANDIDATES_MAX

    assert Sampler(greedy_params()).candidates == 1
    assert Sampler(SamplingParams(top_k=20)).candidates == 20
    assert Sampler(SamplingParams(top_k=TOP_CANDIDATES_MAX)).candidates == TOP_CANDIDATES_MAX
    assert Sampler(SamplingParams(top_k=TOP_CANDIDATES_MAX + 1)).candidates == 0
    assert Sampler(SamplingParams(top_k=0)).candidates == 0
    # penalties that only lower logits: the most candidates (the pick checks they decide it)
    for penalty in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.2)):
        assert Sampler(SamplingParams(top_k=20, **penalty)).candidates == TOP_CANDIDATES_MAX
        assert Sampler(greedy_params(**penalty)).candidates == TOP_CANDIDATES_MAX
        assert Sampler(SamplingParams(top_k=0, **penalty)).candidates == 0
        # top-k at the limit leaves no candidate below the k-th to bound the rest
        assert Sampler(SamplingParams(top_k=TOP_CANDIDATES_MAX, **penalty)).candidates == 0
    # penalties that can raise a logit: whole rows
    for penalty in (dict(repetition_penalty=0.9), dict(presence_penalty=-0.5), dict(frequency_penalty=-0.2)):
        assert Sampler(SamplingParams(top_k=20, **penalty)).candidates == 0
        assert Sampler(greedy_params(**penalty)).candidates == 0


@pytest.mark.parametrize("params", [
    greedy_params(),
    SamplingParams(),  # the defaults: temperature 0.7, top-k 20, top-p 0.8
    SamplingParams(temperature=1.0, top_k=1, top_p=1.0),
    SamplingParams(temperature=1.3, top_k=64, top_p=1.0),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=5, top_p=0.5),
])
def test_a_pick_from_the_top_logits_equals_the_pick_from_the_row(params):
    """The same seed picks the same tokens from the whole rows and from their `candidates` largest
    logits (what a device step returns): rows with many tied values (rounded) and without."""
    from minecart.engine.sampling import TopLogits, top_logits

    rng = np.random.default_rng(11)
    seeded = SamplingParams(**{**params.__dict__, "seed": 5})
    whole, top = Sampler(seeded), Sampler(seeded)
    k = top.candidates
    assert k > 0
    for step in range(60):
        row = (rng.standard_normal(3000) * 3).astype(np.float32)
        if step % 2:
            row = np.round(row)  # ties, at the k-th place too
        vals, ids = top_logits(row, k)
        assert whole(row) == top(TopLogits(vals, ids))
    assert whole.generated == top.generated


def test_top_logits_order_and_a_short_candidate_list():
    from minecart.engine.sampling import TopLogits, top_logits

    row = np.array([1.0, 3.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    vals, ids = top_logits(row, 2)
    np.testing.assert_array_equal(ids, [[1, 2]])  # three tied at 3.0: the lowest ids
    np.testing.assert_array_equal(vals, [[3.0, 3.0]])
    vals, ids = top_logits(row[None, :], 5)
    np.testing.assert_array_equal(ids, [[1, 2, 4, 3, 0]])
    with pytest.raises(ValueError, match="needs 3"):
        Sampler(SamplingParams(top_k=3)).pick(TopLogits(vals[:, :2], ids[:, :2]))
    with pytest.raises(ValueError, match="whole row"):
        Sampler(SamplingParams(top_k=0)).pick(TopLogits(vals, ids))


def test_top_logits_equal_a_sort_of_the_whole_row():
    """top_logits against a full sort of each row (descending value, ascending id), on fresh random rows:
    in no order (the sampled threshold's route), sorted either way, flat, with ties at the k-th, small
    rows and every k (the whole row's selection where the sample cannot bound it)."""
    from minecart.engine.sampling import _SAMPLE_STRIDE, top_logits

    rng = np.random.default_rng()
    for case in range(240):
        V = int(rng.choice([3, 64, 1000, 40_000, 262_144]))
        x = (rng.standard_normal((int(rng.integers(1, 4)), V)) * rng.uniform(0.01, 5)).astype(np.float32)
        shape = case % 5
        if shape == 1:
            x = np.round(x * 2) / 2  # ties at the k-th
        elif shape == 2:
            x = np.sort(x, axis=1)[:, :: int(rng.choice([1, -1]))].copy()  # every sample's k-th below the row's
        elif shape == 3:
            x[:] = 1.0
        k = int(rng.choice([1, 2, 20, 64, 256, V // _SAMPLE_STRIDE // 3 + 1]))
        vals, ids = top_logits(x, k)
        kk = min(k, V)
        for r in range(x.shape[0]):
            want = np.lexsort((np.arange(V), -x[r]))[:kk]
            np.testing.assert_array_equal(ids[r], want)
            np.testing.assert_array_equal(vals[r], x[r, want])


@pytest.mark.parametrize("params", [
    greedy_params(repetition_penalty=1.3),
    SamplingParams(top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.05),  # the app's defaults
    SamplingParams(temperature=1.0, top_k=20, top_p=1.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, top_k=63, top_p=0.95, repetition_penalty=2.0, presence_penalty=0.3),
])
def test_penalized_picks_from_top_logits_equal_whole_rows(params):
    """With penalties that only lower logits a sampler asks for the most candidates and picks from them
    when they decide its pick, else from the whole row it fetches: the same tokens as a sampler given
    the whole rows, seed for seed (rows with the recent tokens near the top, and ties)."""
    from minecart.engine.sampling import TopLogits, top_logits

    rng = np.random.default_rng(21)
    V = 3000
    seeded = SamplingParams(**{**params.__dict__, "seed": 9})
    prompt = [int(t) for t in rng.integers(0, V, 40)]
    whole, top = Sampler(seeded, prompt), Sampler(seeded, prompt)
    for step in range(80):
        row = (rng.standard_normal(V) * 2).astype(np.float32)
        recent = np.array((prompt + whole.generated)[-8:], np.int64)
        row[recent] += rng.uniform(1, 5, recent.size).astype(np.float32)  # seen tokens near the top
        if step % 3 == 0:
            row = np.round(row * 2) / 2  # ties
        vals, ids = top_logits(row, top.candidates)
        assert whole(row) == top(TopLogits(vals, ids, fetch=lambda r, row=row: row))
    assert whole.generated == top.generated


def test_penalties_follow_the_history_as_it_grows():
    """A greedy sampler with all three penalties picks the argmax of each row penalized by the formulas
    over the prompt and every token generated so far, those appended to its history from outside (a
    device's picks) included: the penalties' running view of the history stays in step with it."""
    rng = np.random.default_rng(5)
    V, rep, pres, freq = 400, 1.7, 0.4, 0.3
    prompt = [int(t) for t in rng.integers(0, V, 30)]
    s = Sampler(greedy_params(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq), prompt)
    for step in range(60):
        row = rng.standard_normal(V).astype(np.float64) * 2
        hot = np.array((prompt + s.generated)[-6:], np.int64)
        row[hot] += 3.0  # recent tokens near the top, so the penalties decide
        row = row.astype(np.float32)
        want = row.astype(np.float64)
        for t in set(prompt) | set(s.generated):
            want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
        for t in set(s.generated):
            want[t] -= pres + freq * s.generated.count(t)
        assert s(row) == int(np.argmax(want.astype(np.float32))), step
        if step % 7 == 3:
            s.generated.append(int(rng.integers(0, V)))


def test_penalized_top_logits_decide_or_fetch_the_row():
    """Greedy with a repetition penalty over tokens 0..63: when all 64 candidates are seen tokens just
    above an unseen one, the penalty drops them below it, which only the whole row shows (fetched);
    when the unseen token is among the candidates, they decide (not fetched)."""
    from minecart.engine.sampling import TopLogits, top_logits

    reads = []
    for unseen, want_fetch in ((9.9, True), (11.0, False)):
        row = np.zeros(500, np.float32)
        row[:64] = np.linspace(10.0, 10.2, 64)
        row[100] = unseen
        s = Sampler(greedy_params(repetition_penalty=1.5), prompt_ids=list(range(64)))
        vals, ids = top_logits(row, s.candidates)
        reads.clear()
        assert s.pick(TopLogits(vals, ids, fetch=lambda r, row=row: reads.append(r) or row)) == 100
        assert (reads == [0]) == want_fetch


def test_a_penalized_pick_without_the_rows_says_so():
    from minecart.engine.sampling import TopLogits

    s = Sampler(greedy_params(repetition_penalty=10.0), prompt_ids=list(range(64)))
    vals = np.linspace(10, 9, 64, dtype=np.float32)[None, :]
    with pytest.raises(RuntimeError, match="without their whole rows"):
        s.pick(TopLogits(vals, np.arange(64)[None, :]))  # every candidate seen: they cannot decide


def test_pick_specs_look_ahead_in_the_samplers_own_stream():
    """Sampler.pick_spec(ahead) draws the uniform numbers of picks to come from the sampler's stream,
    in order: a sampler asked for them ahead (what a generate loop that lets the device pick does)
    picks the same tokens as one that is not, and the device's form of each pick (draw_from_top with
    that spec) is the host's pick."""
    from minecart.engine.sampling import GREEDY_PICK, TopLogits, draw_from_top, top_logits

    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=3)
    plain, ahead = Sampler(params), Sampler(params)
    rng = np.random.default_rng(4)
    specs = [ahead.pick_spec(0), ahead.pick_spec(1)]
    for _ in range(200):
        row = (rng.standard_normal(500) * 2).astype(np.float32)
        vals, ids = top_logits(row, 20)
        spec = specs.pop(0)
        assert spec is not None and spec.temperature == 0.9 and spec.top_p == 0.9 and spec.min_p == 0.02
        device = draw_from_top(vals[0], ids[0], spec)
        token = ahead(TopLogits(vals, ids, picks=np.array([device])))
        assert token == device == plain(TopLogits(vals, ids)) == plain.generated[-1]
        specs.append(ahead.pick_spec(1))  # the pick after the next, drawn while that one is pending
    assert len(set(plain.generated)) > 5  # a real draw, not the first candidate each time
    assert Sampler(greedy_params()).pick_spec(1) == GREEDY_PICK
    for unchained in (SamplingParams(top_k=0), SamplingParams(top_k=65), SamplingParams(repetition_penalty=1.1),
                      greedy_params(presence_penalty=0.5)):
        s = Sampler(unchained)
        assert not s.chains and s.pick_spec(0) is None


def test_a_device_pick_stands_only_where_rounding_decides():
    """A step's device pick (TopLogits.picks) that differs from the host's draw with the same spec is
    taken where the uniform number lies within rounding of the boundary between the two tokens (the
    device sums in float64 in another order), and not otherwise."""
    from minecart.engine.sampling import TopLogits

    vals = np.array([[2.0, 1.0, 0.0]], np.float32)
    ids = np.array([[10, 11, 12]])
    w = np.exp(np.array([2.0, 1.0, 0.0]) - 2.0)
    edge = float(w[0] / w.sum())  # u at which the draw goes from token 10 to token 11

    class Fixed(Sampler):
        def __init__(self, u):
            super().__init__(SamplingParams(temperature=1.0, top_k=3, top_p=1.0))
            self._ahead.append(u)

    assert Fixed(edge - 1e-13)(TopLogits(vals, ids, picks=np.array([11]))) == 11  # rounding decides
    assert Fixed(edge - 1e-13)(TopLogits(vals, ids)) == 10
    assert Fixed(0.2)(TopLogits(vals, ids, picks=np.array([11]))) == 10  # far from it: the host's draw


def test_penalty_table_and_penalized_pick_specs():
    """The device's penalty table (PenaltyHistory.table): PROMPT_BIT for each prompt id, plus how many
    times each id was generated among the first `counted`, ids outside the vocabulary left out; and a
    sampler given the vocabulary chains with penalties that only lower logits, its PickSpec carrying
    them, its top-k and its own lists."""
    from minecart.engine.sampling import PROMPT_BIT, TOP_CANDIDATES_MAX, PenaltyHistory

    h = PenaltyHistory([3, 3, 9, 70], [9, 4, 4, 1, 4, 99], vocab=50)
    keys, vals = h.table(5)
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == {1: 1, 3: PROMPT_BIT, 4: 3, 9: PROMPT_BIT + 1}
    keys, vals = h.table(0)
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == {3: PROMPT_BIT, 9: PROMPT_BIT}
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.2, seed=1)
    s = Sampler(params, [1, 2], vocab=1000)
    assert s.chains and s.candidates == TOP_CANDIDATES_MAX
    s.generated.append(7)
    spec = s.pick_spec(0)
    assert spec is not None and spec.history is not None
    assert (spec.top_k, spec.repetition, spec.presence, spec.frequency) == (20, 1.1, 0.5, 0.2)
    assert list(spec.history.prompt_ids) == [1, 2] and list(spec.history.generated) == [7]  # the sampler's
    assert spec.as_array().tolist() == [spec.u, 0.8, 0.9, 0.0, 20, 1.1, 0.5, 0.2]
    g = Sampler(greedy_params(repetition_penalty=1.3), vocab=1000).pick_spec(0)
    assert g is not None and g.temperature == 0 and g.top_k == 1 and g.history is not None
    for unchained in (SamplingParams(top_k=0, repetition_penalty=1.1), SamplingParams(repetition_penalty=0.9),
                      SamplingParams(top_k=TOP_CANDIDATES_MAX, presence_penalty=0.5),
                      greedy_params(presence_penalty=-0.5)):
        assert not Sampler(unchained, vocab=1000).chains


def test_a_penalized_rows_top_logits_are_drawn_from_as_given():
    """Top logits the device penalized already (TopLogits.penalized) are not penalized again: the pick
    is the draw over their first k, the token a host pick from the whole penalized row gives."""
    from minecart.engine.sampling import TOP_CANDIDATES_MAX, TopLogits, apply_penalties, top_logits

    rng = np.random.default_rng(8)
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, repetition_penalty=1.4, frequency_penalty=0.3,
                            seed=2)
    prompt = rng.integers(0, 300, 40).tolist()
    on_row, on_top = Sampler(params, prompt, vocab=300), Sampler(params, prompt, vocab=300)
    for _ in range(60):
        row = (rng.standard_normal(300) * 3).astype(np.float32)
        pen = apply_penalties(row, params, prompt, on_top.generated)
        vals, ids = top_logits(pen, TOP_CANDIDATES_MAX)
        assert on_top(TopLogits(vals, ids, penalized=True)) == on_row(row)
    assert on_top.generated == on_row.generated and len(set(on_row.generated)) > 5


def test_the_compiled_candidate_loop_equals_its_source_run_as_written():
    """The loop of a pick from a step's candidates, compiled by numba (what every pick runs), gives the
    same bits as the same function run by the interpreter, on fresh random candidates: penalties on
    some of them (ties among the penalized and the rest included), every filter, every k, greedy."""
    pytest.importorskip("numba")
    from minecart.engine.sampling import _candidate_loop, _compiled_candidate_loop

    compiled = _compiled_candidate_loop()
    assert compiled is not _candidate_loop
    rng = np.random.default_rng()
    for case in range(400):
        n = int(rng.integers(1, 65))
        v = np.sort((rng.standard_normal(n) * rng.uniform(0.1, 5)).astype(np.float32))[::-1]
        if case % 4 == 0:
            v = np.round(v * 2) / 2  # equal values
        ids = np.sort(rng.choice(100_000, n, replace=False)).astype(np.int64)
        order = np.lexsort((ids, -v))  # descending, ties by ascending id: as a step gives them
        v, ids = v[order].astype(np.float64), ids[order]
        marks = (rng.random(n) < 0.3, np.where(rng.random(n) < 0.2, rng.integers(1, 4, n), 0).astype(np.int64))
        if case % 5 == 0:
            marks = (np.zeros(0, np.bool_), np.zeros(0, np.int64))  # none penalized
        args = (v, ids, int(rng.integers(1, n + 1)), *marks, float(rng.choice([1.0, 1.05, 1.5, 0.9])),
                float(rng.choice([0.0, 0.5])), float(rng.choice([0.0, 0.25])),
                float(rng.choice([0.0, 0.3, 1.0, 2.0])), float(rng.choice([1.0, 0.9, 0.5])),
                float(rng.choice([0.0, 0.05, 0.3])))
        for got, want in zip(compiled(*args), _candidate_loop(*args), strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want), case  # bit for bit


def test_a_penalized_pick_the_candidates_do_not_decide_is_the_whole_rows():
    """When the penalized candidates do not decide a pick, pick_penalized reads the whole row and draws
    what the whole penalized row gives (kept_tokens' route): from the few logits at or above the
    candidates' k-th penalized one, or, when thousands tie there, from the whole row's top-k; on fresh
    random rows with most candidates seen, flat rows and ties, every filter and k."""
    from minecart.engine.sampling import (
        _FEW,
        PenaltyView,
        PickSpec,
        TopLogits,
        _candidates,
        _penalized,
        _pick_row,
        pick_penalized,
        top_logits,
    )

    rng = np.random.default_rng()
    V = 12_000
    routes = {"few": 0, "many": 0}
    for case in range(300):
        row = (rng.standard_normal(V) * rng.uniform(0.02, 3)).astype(np.float32)
        if case % 3 == 0:
            row = np.round(row * 2) / 2  # ties
        if case % 10 == 0:
            row[:] = 1.0  # one value everywhere: every logit ties with the candidates' k-th
        vals, ids = top_logits(row, 64)
        view = PenaltyView(rng.choice(ids[0], int(rng.integers(30, 65)), replace=False).tolist())
        view.add(rng.choice(ids[0], int(rng.integers(0, 8))).tolist())
        spec = PickSpec(float(rng.random()), float(rng.choice([0.0, 0.7, 1.2])), float(rng.choice([1.0, 0.9])),
                        float(rng.choice([0.0, 0.05])), top_k=int(rng.choice([1, 20, 40, 63])),
                        repetition=float(rng.choice([1.05, 1.3])), presence=float(rng.choice([0.0, 0.4])),
                        frequency=float(rng.choice([0.0, 0.2])))
        penalties = (spec.repetition, spec.presence, spec.frequency)
        best = _candidates(vals[0], ids[0], spec.top_k, spec, penalties, view)[0]
        if best[-1] > vals[0, -1]:
            continue  # the candidates decide: other tests
        whole = _penalized(row, None, penalties, view)
        routes["few" if np.count_nonzero(whole >= best[-1]) <= _FEW else "many"] += 1
        got = pick_penalized(TopLogits(vals, ids, fetch=lambda r, row=row: row), spec, view, 64)
        assert got == _pick_row(whole, spec, spec.u), case
    assert routes["few"] > 50 and routes["many"] > 10, routes


def test_a_numba_that_cannot_compile_the_loop_leaves_it_as_written(monkeypatch, caplog):
    """When numba is there but fails to compile the candidate loop, picks still work: the loop runs as
    written, and the log says so once."""
    numba = pytest.importorskip("numba")
    from minecart.engine import sampling
    from minecart.engine.sampling import (
        PickSpec,
        _candidate_loop,
        _compiled_candidate_loop,
        draw_from_top,
    )

    def broken_njit(*_args, **_kwargs):
        def wrap(_fn):
            def compiled(*_a):
                raise numba.core.errors.TypingError("no compiler here")
            return compiled
        return wrap

    vals = np.array([3.0, 2.0, 1.0], np.float32)
    ids = np.array([7, 5, 9], np.int64)
    spec = PickSpec(0.99, 1.0, 1.0, 0.0)
    want = draw_from_top(vals, ids, spec)
    monkeypatch.setattr(numba, "njit", broken_njit)
    _compiled_candidate_loop.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=sampling.__name__):
            assert _compiled_candidate_loop() is _candidate_loop
            assert draw_from_top(vals, ids, spec) == want == 9
        assert "runs uncompiled" in caplog.text and "no compiler here" in caplog.text
    finally:
        _compiled_candidate_loop.cache_clear()
