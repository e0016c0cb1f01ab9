"""GGUF fuzzing in the test run: mutated fixture files (tests/fuzz/gguf_fuzz.py) through the real
loaders; every outcome must be a clean MinecartError or a successful load - no other exception, no
hang past the per-case limit, no allocation past the memory limit.

The bounded run (120 cases, fixed seed, about 10 s on two cores) is part of every test run. A longer
run on demand: `MINECART_FUZZ_CASES=20000 MINECART_FUZZ_SEED=7 python -m pytest -q -s
tests/fuzz/test_fuzz_gguf.py` (about 15 cases a second on two busy cores: 3000 in 3 minutes). A find is kept as a recipe in
tests/data/fuzz_corpus/gguf/ and replayed here with its expected outcome.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.fuzz import gguf_fuzz

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fuzz_corpus" / "gguf"
CASES = int(os.environ.get("MINECART_FUZZ_CASES", "120"))
SEED = int(os.environ.get("MINECART_FUZZ_SEED", "0"))


def test_mutated_files_load_or_fail_cleanly(fixtures_dir):
    recipes = gguf_fuzz.random_recipes(CASES, SEED, fixtures_dir)
    outcomes = gguf_fuzz.run_cases(recipes, fixtures_dir)
    counts = gguf_fuzz.counts(outcomes)
    print(f"GGUF fuzz, {CASES} cases, seed {SEED}: {counts}")
    bad = [(o, recipes[o.case]) for o in outcomes if o.outcome not in ("clean", "loaded")]
    assert not bad, "\n".join(f"{o.outcome}: {o.detail}\n  recipe: {json.dumps(r)}" for o, r in bad)
    assert len(outcomes) == CASES
    assert counts["clean"] and counts["loaded"]  # the mutations reach both paths


def test_corpus_of_past_finds_replays(fixtures_dir):
    entries = {p.stem: json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))}
    assert entries, f"no corpus under {CORPUS}"
    names = list(entries)
    outcomes = gguf_fuzz.run_cases([entries[n]["recipe"] for n in names], fixtures_dir)
    for o in outcomes:
        name = names[o.case]
        allowed = entries[name]["expect"].split(" or ")
        assert o.outcome in allowed, f"{name}: {o.outcome} ({o.detail}); expected {allowed}"
