"""Whole-model comparison helpers of the GPU tests (test_model.py, test_hfma2.py, test_kvq3_model.py,
test_moe_gpu.py): logit agreement against a reference model, greedy continuations, and the replayed
CUDA-graph decode against the eager step."""

from __future__ import annotations

import numpy as np

FIXTURES = {"q8_0": "dense/qwen35-tiny-dense-q8_0.gguf", "f16": "dense/qwen35-tiny-dense-f16.gguf"}


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """Per-position logit agreement: max relative error, top-1 agreement, KL(ref || got) mean and max."""
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    rel = np.max(np.abs(got - ref), axis=-1) / np.max(np.abs(ref), axis=-1)

    def logsoftmax(a):
        a = a - a.max(axis=-1, keepdims=True)
        return a - np.log(np.exp(a).sum(axis=-1, keepdims=True))

    lp, lq = logsoftmax(ref), logsoftmax(got)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return {"max_rel": float(rel.max()), "top1": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def worst_over_sequences(m_ref, m_got, seqs, label: str) -> dict:
    """compare() of the two models' logits on every fixture sequence (printed, one line each, prefixed
    by `label`); returns the worst of each measure, also printed."""
    worst = {"max_rel": 0.0, "top1": 1.0, "kl_mean": 0.0, "kl_max": 0.0}
    for seq in seqs:
        r = compare(m_ref.logits(seq["ids"]), m_got.logits(seq["ids"]))
        print(f"{label} {seq['name']:>10} ({seq['len']:>3} tokens): max rel {r['max_rel']:.2e} "
              f"top-1 {r['top1']:.3f} KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e}")
        worst = {"max_rel": max(worst["max_rel"], r["max_rel"]), "top1": min(worst["top1"], r["top1"]),
                 "kl_mean": max(worst["kl_mean"], r["kl_mean"]), "kl_max": max(worst["kl_max"], r["kl_max"])}
    print("worst:", worst)
    return worst


def greedy(model, ids, n, *, chunk=None, capacity=None):
    """n greedy tokens after prefilling ids (in chunks of `chunk` tokens when given) in a new session
    of `capacity` positions (default: just enough)."""
    s = model.new_session(capacity or len(ids) + n + 1)
    logits = s.prefill([int(t) for t in ids], chunk=chunk)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = s.step(out[-1])
    s.close()
    return out


def graph_vs_eager(sg, se, prompt, steps: int, truncate_at: int | None = None) -> float:
    """Prefill `prompt` in a graph session sg and an eager session se, then decode `steps` greedy tokens
    (the eager session's) in both, asserting max |graph - eager| <= 1e-5 max |eager| at every step. At
    step `truncate_at` both are truncated to len(prompt) + 10. Returns the worst relative error."""
    lg, le = sg.prefill(prompt), se.prefill(prompt)
    worst = 0.0
    for i in range(steps):
        tok = int(np.argmax(le))
        lg, le = sg.step(tok), se.step(tok)
        err = float(np.max(np.abs(lg - le)) / np.max(np.abs(le)))
        worst = max(worst, err)
        assert err <= 1e-5, f"step {i}: {err}"
        if i == truncate_at:
            sg.truncate(len(prompt) + 10)
            se.truncate(len(prompt) + 10)
            lg, le = sg.last_logits, se.last_logits
            if lg is None or le is None:
                lg, le = sg.step(tok), se.step(tok)
    return worst
