"""The context limit on the GPU (engine/session.py): a model loaded on cuda:0 with context N allocates
every session's KV caches for exactly N rows, the bytes its plan prices, for each KV type; a greedy
generation runs (captured decode graphs) right up to the limit, writing the caches' last row, agrees
with the NumPy model under the same limit, and the session then refuses one more token."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import kvquant as kq
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.errors import ContextFullError
from minecart.engine.generation import generate
from minecart.engine.model import load_model
from minecart.engine.sampling import greedy_params

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

FIXTURE = "dense/qwen35-tiny-dense-q8_0.gguf"
LIMIT = 48


@pytest.mark.parametrize("kv", kq.KV_TYPES)
def test_a_gpu_session_holds_the_planned_context_and_runs_to_its_end(fixtures_dir, kv):
    path = fixtures_dir / FIXTURE
    m_gp = load_model(path, devices=["cuda:0"], mmproj=False, kv_type=kv, context=LIMIT)
    m_np = load_model(path, backend=NumpyBackend(), mmproj=False, kv_type=kv, context=LIMIT)
    try:
        planned = m_gp.placement.bytes_per_device()["cuda:0"].kv_cache
        s = m_gp.new_session()
        caches = [st.kv for st in s.states if st.kv is not None]
        assert caches and all(c.capacity == LIMIT for c in caches)
        assert sum(c.nbytes for c in caches) == planned == LIMIT * sum(
            kq.kv_bytes_per_token(m_gp.config, kv) for _ in caches)
        prompt = list(range(100, 140))
        got = list(generate(m_gp, prompt, greedy_params(max_tokens=100), session=s))
        ref = list(generate(m_np, prompt, greedy_params(max_tokens=100)))
        assert got[-1].finish_reason == "length" == ref[-1].finish_reason
        assert got[-1].generated_tokens == LIMIT - len(prompt) == ref[-1].generated_tokens
        tokens = [e.token for e in got]
        print(f"\n{kv}: GPU {tokens}\n{kv}: CPU {[e.token for e in ref]}")
        if kv != "q3":  # the 3-bit cache's greedy agreement is tests/gpu/test_kvq3_model.py's
            assert tokens == [e.token for e in ref]
        # the last answer token is not fed: the caches hold LIMIT - 1 rows, never grown
        assert all(c.capacity == LIMIT and c.length == LIMIT - 1 for c in caches)
        assert sum(c.nbytes for c in caches) == planned
        logits = s.step(int(tokens[-1]))  # row LIMIT - 1, the caches' last
        assert np.all(np.isfinite(logits)) and s.n_tokens == LIMIT
        with pytest.raises(ContextFullError):
            s.step(1)
        assert s.n_tokens == LIMIT and all(c.length == LIMIT for c in caches)
        s.close()
    finally:
        m_gp.close()
        m_np.close()
