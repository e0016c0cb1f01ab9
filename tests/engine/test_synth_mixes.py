"""`minecart synth --quant q4_k_m | q5_k_m` against llama.cpp's own llama-quantize: the type of every
tensor of small synthetic models (dense tied and untied, MoE, rows too narrow for 256-value blocks) in
both mixes, as llama-quantize wrote them (tests/data/llama_quantize_mixes.json, made by
tools/llama_quantize_mixes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.models.qwen35 import Shape
from minecart.engine.quant_mix import MIXES
from minecart.engine.synth import plan_tensors, write_synthetic

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "llama_quantize_mixes.json").read_text())


def _shape(case: str) -> Shape:
    fields = dict(REFERENCE["cases"][case]["shape"])
    fields["rope_sections"] = tuple(fields["rope_sections"])
    return Shape(**fields)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_types_match_llama_quantize(case, mix):
    want = REFERENCE["cases"][case][mix]
    got = {t.name: Q.type_name(t.type_id) for t in plan_tensors(_shape(case), MIXES[mix.lower()])}
    assert set(got) == set(want)
    differ = {n: (got[n], want[n]) for n in got if got[n] != want[n]}
    assert not differ, differ


def test_the_reference_has_what_the_mixes_raise():
    """The cases exercise each rule: Q6_K output or tied embeddings, Q6_K and base attn_v / attn_qkv
    and ffn_down, and the narrow-row fallbacks (the test above can fail on each)."""
    seen: dict[str, set[str]] = {}
    for case in REFERENCE["cases"].values():
        for name, t in case["Q4_K_M"].items():
            kind = name.split(".")[-2] if name.startswith("blk.") else name
            seen.setdefault(kind, set()).add(t)
    assert {"Q4_K", "Q6_K"} <= seen["attn_qkv"] and {"Q4_K", "Q6_K"} <= seen["attn_v"]
    assert {"Q4_K", "Q6_K"} <= seen["ffn_down"] and {"Q4_K", "Q6_K"} <= seen["ffn_down_exps"]
    assert "Q6_K" in seen["output.weight"] and "Q6_K" in seen["token_embd.weight"]
    assert "Q5_0" in seen["ffn_up"] and "Q8_0" in seen["token_embd.weight"]  # 32-wide rows


def test_mixed_file_reads_back(tmp_path):
    p = tmp_path / "m.gguf"
    write_synthetic(p, _shape("small-dense-24-untied"), "q4_k_m", seed=2, n_layers=8)
    gf = GGUFFile(p)
    assert gf.get("general.file_type") == 15
    assert gf.tensor("output.weight").type_name == "Q6_K" and gf.tensor("token_embd.weight").type_name == "Q4_K"
    assert gf.tensor("blk.0.ffn_down.weight").type_name == "Q6_K"  # the first eighth of 9 blocks
