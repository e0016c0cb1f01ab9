"""A tiny random Gemma 3 (tests/_gemma3.py) on the NumPy reference: the sliding window is really
applied (a longer window changes the logits past it, not before), and whole, chunked and token-by-token
prefill agree. The same file checks the GPU path against this reference (tests/gpu/test_gemma3_gpu.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from minecart.engine.model import load_model
from minecart.engine.sampling import greedy_params

from tests._gemma3 import WINDOW, tiny_gemma3_file

PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 512, 40)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model = load_model(tiny_gemma3_file(tmp_path_factory.mktemp("g3") / "tiny-gemma3.gguf"),
                       devices=["cpu:0"])
    yield model
    model.close()


def test_the_sliding_window_limits_what_sliding_layers_see(gemma):
    base = gemma.logits(PROMPT)
    saved = gemma.config
    try:
        gemma.config = dataclasses.replace(saved, sliding_window=1000)
        gemma.executor.config = gemma.config
        wide = gemma.logits(PROMPT)
    finally:
        gemma.config = saved
        gemma.executor.config = saved
    np.testing.assert_array_equal(wide[:WINDOW], base[:WINDOW])  # nothing to cut yet
    assert np.abs(wide[WINDOW + 1 :] - base[WINDOW + 1 :]).max() > 1e-3


def test_whole_chunked_and_stepwise_prefill_agree(gemma):
    results = []
    for chunk in (None, 7, 1):
        session = gemma.new_session()
        session.prefill(PROMPT, chunk=chunk)
        events = list(gemma.generate(PROMPT, greedy_params(max_tokens=16), session=session))
        results.append([e.token for e in events])
        session.close()
    assert results[0] == results[1] == results[2]
