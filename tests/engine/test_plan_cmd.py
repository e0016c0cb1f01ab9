"""`minecart plan`: fit / no fit with advice that really fits, host experts, --exclude, JSON keys, the
issue's targets (9B Q4_K at 48K on one 8 GiB card; 27B Q4_K at 32K on 8+8+6 GiB), and bad input."""

from __future__ import annotations

import json

import pytest
from minecart.engine.cli import main
from minecart.engine.placement import KV_BYTES_PER_VALUE, GiB, MiB, Placement, costs_for_shape


def plan(capsys, *args) -> tuple[int, dict]:
    rc = main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_9b_q4k_at_48k_fits_one_8gib_card_with_the_default_kv(capsys):
    rc, r = plan(capsys, "--shape", "qwen3.5-9b", "--quant", "q4_k", "--rig", "cuda:0=8GiB", "--context", "49152")
    assert rc == 0 and r["fits"] is True
    assert r["context"] == 49152 and r["kv_type"] == "f16"
    (dev,) = r["devices"]
    assert dev["name"] == "cuda:0" and dev["capacity_bytes"] == 8 * GiB
    assert 0 < dev["planned_bytes"] <= 8 * GiB - r["reserve_bytes"]
    assert dev["parts"] == ["embed"] + [f"blk.{i}" for i in range(32)] + ["head"]
    assert set(r["predicted"]) >= {"decode_tokens_per_s", "prefill_tokens_per_s"}
    assert r["predicted"]["decode_tokens_per_s"] > 0 and r["predicted"]["prefill_tokens_per_s"] > 0
    # 9B: 8 attention layers x 4 KV heads x (256 + 256) values x 2 bytes
    assert r["kv_bytes_per_token"] == 8 * 4 * 512 * 2
    assert r["max_context"] >= 49152


def test_27b_q4k_at_32k_fits_8_8_6(capsys):
    rc, r = plan(capsys, "--shape", "qwen3.5-27b", "--quant", "q4_k", "--rig",
                 "cuda:0=8GiB,cuda:1=8GiB,cuda:2=6GiB", "--context", "32768")
    assert rc == 0 and r["fits"]
    parts = [p for d in r["devices"] for p in d["parts"]]
    expected = ["embed"] + [f"blk.{i}" for i in range(64)] + ["head"]
    assert sorted(parts, key=expected.index) == expected  # every part once
    for d in r["devices"]:  # each device a run of consecutive parts (in whichever device order is best)
        first = expected.index(d["parts"][0])
        assert d["parts"] == expected[first : first + len(d["parts"])]
        assert d["planned_bytes"] + r["reserve_bytes"] <= d["capacity_bytes"]
    # the weight arenas' padding (part of 'other'): one arena per part, each part on one card, so the
    # cards' shares add up to the one-device figure; under a 2 MiB page per part a card holds (it was
    # 136-210 MiB a card when the driver rounded every weight array on its own)
    one = Placement.single(costs_for_shape("qwen3.5-27b", "Q4_K"), "cuda:0", context=32768, kv_type="f16")
    assert sum(d["rounding_bytes"] for d in r["devices"]) == one.bytes_per_device()["cuda:0"].rounding > 0
    assert all(0 < d["rounding_bytes"] < 2 * MiB * len(d["parts"]) for d in r["devices"])
    assert all(d["rounding_bytes"] <= d["other_bytes"] for d in r["devices"])


def test_no_fit_says_what_would_and_each_suggestion_fits(capsys):
    import re

    args = ["--shape", "qwen3.5-9b", "--quant", "q4_k", "--rig", "cuda:0=8GiB"]
    rc, r = plan(capsys, *args, "--context", "131072")
    assert rc == 1 and r["fits"] is False
    text = " ".join(r["suggestions"])
    longest = r["max_context"]
    assert f"--context {longest}" in text and 48000 < longest < 131072
    assert plan(capsys, *args, "--context", str(longest))[0] == 0  # the suggested context fits
    assert plan(capsys, *args, "--context", str(longest + 512))[0] == 1  # and is the longest
    kv = re.search(r"--kv-type (\w+)", text).group(1)
    assert plan(capsys, *args, "--context", "131072", "--kv-type", kv)[0] == 0
    order = ["f16", "q8_0", "q3"]
    for between in order[1:order.index(kv)]:  # the first smaller type that fits is the one named
        assert plan(capsys, *args, "--context", "131072", "--kv-type", between)[0] == 1
    # the table form explains on stderr and exits 1 too
    assert main(["plan", *args, "--context", "131072"]) == 1
    out = capsys.readouterr()
    assert "DOES NOT FIT" in out.out and "What would" in out.err


def test_parallel_sequences_each_hold_the_whole_context(capsys):
    """--parallel N (serve --parallel, the app's "Requests at once"): N KV caches of the whole context.
    9B Q4_K on one 8 GiB card: 4 sequences of 16K fit (4 x 16,384 x 32 KiB = 2 GiB of KV); 4 of 48K do
    not, and each suggestion fits: a shorter context for each, fewer at once, a smaller KV type."""
    import re

    args = ["--shape", "qwen3.5-9b", "--quant", "q4_k", "--rig", "cuda:0=8GiB"]
    rc, one = plan(capsys, *args, "--context", "16384")
    rc4, four = plan(capsys, *args, "--context", "16384", "--parallel", "4")
    assert rc == rc4 == 0 and one["parallel"] == 1 and four["parallel"] == 4
    assert four["kv_bytes_per_token"] == one["kv_bytes_per_token"]  # per token of one sequence
    kv1, kv4 = one["devices"][0]["kv_cache_bytes"], four["devices"][0]["kv_cache_bytes"]
    assert kv1 == 16384 * one["kv_bytes_per_token"] and kv4 == 4 * kv1
    assert four["devices"][0]["planned_bytes"] - one["devices"][0]["planned_bytes"] >= 3 * kv1
    assert four["max_context"] < one["max_context"]
    rc, r = plan(capsys, *args, "--context", "49152", "--parallel", "4")
    assert rc == 1 and not r["fits"]
    text = " ".join(r["suggestions"])
    longest = r["max_context"]
    assert f"--context {longest}" in text and "for each of 4 sequences" in text
    assert plan(capsys, *args, "--context", str(longest), "--parallel", "4")[0] == 0
    fewer = int(re.search(r"--parallel (\d+)", text).group(1))
    assert fewer < 4 and plan(capsys, *args, "--context", "49152", "--parallel", str(fewer))[0] == 0
    assert plan(capsys, *args, "--context", "49152", "--parallel", str(fewer + 1))[0] == 1
    kv = re.search(r"--kv-type (\w+)", text).group(1)
    assert plan(capsys, *args, "--context", "49152", "--parallel", "4", "--kv-type", kv)[0] == 0
    assert main(["plan", *args, "--context", "16384", "--parallel", "4"]) == 0
    assert "for each of 4 sequences at once" in capsys.readouterr().out


def test_weights_too_big_asks_for_memory(capsys):
    rc, r = plan(capsys, "--shape", "qwen3.5-27b", "--quant", "q4_k", "--rig", "cuda:0=6GiB")
    assert rc == 1 and "more memory" in r["suggestions"][0]


def test_host_experts(capsys):
    args = ["--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--context", "8192"]
    rc, r = plan(capsys, *args, "--rig", "cuda:0=P104-100")
    assert rc == 1 and any("--host-experts" in s for s in r["suggestions"])  # no host in the rig: add it
    rc, r = plan(capsys, *args, "--rig", "cuda:0=P104-100,cpu:0=48GiB", "--host-experts")
    assert rc == 0
    gpu, cpu = r["devices"]
    assert gpu["parts"] == ["embed"] + [f"blk.{i}" for i in range(40)] + ["head"]
    assert cpu["parts"] == [f"blk.{i}.experts" for i in range(40)]
    assert cpu["weights_bytes"] > 10 * GiB > gpu["weights_bytes"]
    assert cpu["kv_cache_bytes"] == 0 and gpu["kv_cache_bytes"] > 0  # attention stays with its layer
    # the experts sit in host RAM twice: the file's pages the CPU decodes from, the pinned copy prefill
    # streams from
    assert cpu["pinned_bytes"] == cpu["weights_bytes"] and gpu["pinned_bytes"] == 0
    assert cpu["planned_bytes"] >= 2 * cpu["weights_bytes"]
    # so a 32 GiB host holds them only as the file's pages: no plan puts every layer's experts there
    rc, r = plan(capsys, *args, "--rig", "cuda:0=P104-100,cpu:0=32GiB", "--host-experts")
    assert not (rc == 0 and r["devices"][1]["parts"] == [f"blk.{i}.experts" for i in range(40)])


@pytest.mark.parametrize("kv", list(KV_BYTES_PER_VALUE))
def test_every_kv_type(capsys, kv):
    rc, r = plan(capsys, "--shape", "qwen3.5-27b", "--quant", "q4_k", "--rig", "cuda:0=24GiB",
                 "--context", "16384", "--kv-type", kv)
    assert rc == 0 and r["kv_type"] == kv
    # 27B: 16 attention layers x 4 KV heads x 512 values, at the type's bytes per value
    assert r["kv_bytes_per_token"] == round(16 * 4 * 512 * KV_BYTES_PER_VALUE[kv])
    assert r["devices"][0]["kv_cache_bytes"] == r["kv_bytes_per_token"] * 16384


def test_q3_kv_of_27b_at_256k(capsys):
    rc, r = plan(capsys, "--shape", "qwen3.5-27b", "--quant", "q4_k", "--rig", "cuda:0=48GiB",
                 "--context", "262144", "--kv-type", "q3")
    assert rc == 0
    # 16 attention layers x 4 KV heads x (a K row of 256 values: 96 bytes of 3-bit codes + 4 fp16 scales,
    # a V row: 64 bytes of 2-bit codes + 4 scales) per token: 2.75 bits per value, 2.95 GB at 256K, inside
    # the 3.0 GB (qengine's write-up: 3.5 GB)
    assert r["devices"][0]["kv_cache_bytes"] == 16 * 4 * ((96 + 8) + (64 + 8)) * 262144 == 2_952_790_016


def test_faster_card_first_and_exclude(capsys):
    rig = "cuda:0=P104-100@gen1x1,cuda:1=CMP-100-210@gen1x1"
    args = ["--shape", "qwen3.5-9b", "--quant", "q4_k", "--context", "32768"]
    rc, r = plan(capsys, *args, "--rig", rig)
    assert rc == 0
    by = {d["name"]: d for d in r["devices"]}
    assert by["cuda:1"]["card"] == "CMP 100-210" and "blk.0" in by["cuda:1"]["parts"]
    fast = r["predicted"]["decode_tokens_per_s"]
    rc, r = plan(capsys, *args, "--rig", rig, "--exclude", "cuda:1")
    assert rc == 0 and [d["name"] for d in r["devices"]] == ["cuda:0"]
    assert r["devices"][0]["parts"][0] == "embed" and r["predicted"]["decode_tokens_per_s"] < fast


def test_the_table(capsys):
    assert main(["plan", "--shape", "qwen3.5-9b", "--quant", "q4_k", "--rig", "cuda:0=P104-100,cuda:1=6GiB",
                 "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "embed, blk.0-31, head" in out and "predicted: decode" in out


def test_a_fixture_file(capsys, fixtures_dir):
    rc, r = plan(capsys, str(fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf"), "--rig", "cuda:0=1GiB")
    assert rc == 0 and r["devices"][0]["parts"] == ["embed"] + [f"blk.{i}" for i in range(8)] + ["head"]
    assert r["kv_bytes_per_token"] == 2 * 2 * 128 * 2  # 2 attention layers x 2 KV heads x (64+64) x f16


@pytest.mark.parametrize("args,words", [
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=GTX 9999"], "no profile for a card called 'GTX 9999'"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0"], "cuda:0 has no memory size"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--exclude", "cuda:3"], "no such device"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--exclude", "cuda:0"], "every device"),
    (["--rig", "cuda:0=8GiB"], "give a GGUF file, or --shape"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--host-experts"], "no routed experts"),
    (["--shape", "qwen3.6-35b-a3b", "--rig", "cuda:0=8GiB", "--host-experts"], "add e.g. cpu:0"),
    (["--shape", "qwen3.5-9b", "--rig", "cpu:0=P104-100"], "CPU device"),
    (["--shape", "qwen3.5-9b", "--quant", "zz", "--rig", "cuda:0=8GiB"], "unknown quant type 'ZZ'; choose one of"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--context", "300000"], "trained for (262144 tokens)"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--context", "0"], "give 1 or more"),
    (["--shape", "qwen3.5-9b", "--rig", "cuda:0=8GiB", "--parallel", "0"], "give 1 or more sequences"),
])
def test_bad_input_is_explained(capsys, args, words):
    assert main(["plan", *args]) == 1
    assert words in capsys.readouterr().err


def test_without_a_rig_the_gpus_of_this_machine(capsys, monkeypatch):
    from minecart.engine import devices
    from minecart.engine.devices import DeviceInfo

    gpus = [DeviceInfo("cuda:0", "cuda", "NVIDIA P104-100", 8 * GiB, 0, 8 * GiB),
            DeviceInfo("cuda:1", "cuda", "NVIDIA CMP 100-210", 16 * GiB, GiB, 15 * GiB),
            DeviceInfo("cuda:2", "cuda", "NVIDIA Tesla K80", 12 * GiB, 0, 12 * GiB)]
    cpu = DeviceInfo("cpu:0", "cpu", "a CPU", 64 * GiB, 0, 60 * GiB)
    monkeypatch.setattr(devices, "list_devices",
                        lambda include_cpu=True, with_probe=True: gpus + ([cpu] if include_cpu else []))
    args = ["--shape", "qwen3.5-9b", "--quant", "q4_k", "--context", "32768"]
    rc, r = plan(capsys, *args)
    assert rc == 0
    by = {d["name"]: d for d in r["devices"]}
    assert list(by) == ["cuda:0", "cuda:1", "cuda:2"]
    assert by["cuda:1"]["capacity_bytes"] == 15 * GiB and by["cuda:1"]["card"] == "CMP 100-210"
    assert by["cuda:2"]["card"] == "" and by["cuda:2"]["label"] == "NVIDIA Tesla K80"  # no profile
    assert by["cuda:1"]["parts"][0] == "embed"  # the fastest card, though listed second
    rc, r = plan(capsys, *args, "--exclude", "cuda:1", "--exclude", "cuda:2")
    assert rc == 0 and [d["name"] for d in r["devices"]] == ["cuda:0"]
    assert main(["plan", *args, "--exclude", "cuda:7"]) == 1
    assert "this machine has no such device (cuda:0, cuda:1, cuda:2)" in capsys.readouterr().err
    monkeypatch.setattr(devices, "list_devices",
                        lambda include_cpu=True, with_probe=True: [cpu] if include_cpu else [])
    assert main(["plan", *args]) == 1
    assert "no GPU found on this machine" in capsys.readouterr().err


MOE35 = ["--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--context", "8192"]


def test_experts_on_host_shows_the_staging_buffers(capsys):
    from minecart.engine.placement import costs_for_shape

    layer = costs_for_shape("qwen3.6-35b-a3b", "Q4_K").part("layer.0").expert_bytes
    rc, r = plan(capsys, *MOE35, "--rig", "cuda:0=P104-100,cpu:0=48GiB", "--experts-on", "host")
    assert rc == 0 and r["experts"] == {f"blk.{i}": "cpu:0" for i in range(40)}
    gpu, cpu = r["devices"]
    assert gpu["expert_staging_bytes"] == 2 * layer and cpu["expert_staging_bytes"] == 0
    assert gpu["other_bytes"] >= 2 * layer
    assert cpu["pinned_bytes"] == 40 * layer and cpu["other_bytes"] >= 40 * layer
    main(["plan", *MOE35, "--rig", "cuda:0=P104-100,cpu:0=48GiB", "--experts-on", "host"])
    out = capsys.readouterr().out
    assert "the two buffers that host-RAM experts are streamed into" in out
    assert "the page-locked copy of its experts that prefill streams from" in out


def test_experts_on_host_says_whether_prefill_streams_them(capsys):
    """The runtime's rule (placement.stream_min_tokens): a prefill run streams a layer's host-RAM
    experts when copying them over the card's link is quicker than the CPU's integer kernels running the
    run's tokens; behind a Gen1 x1 riser the 2,048-token runs stay on the CPU, behind Gen3 x4 they
    stream. The JSON carries the threshold, the text says which."""
    from minecart.engine.placement import stream_min_tokens
    from minecart.engine.rig import LINKS

    layer = costs_for_shape("qwen3.6-35b-a3b", "Q4_K").part("layer.0")
    for link, streams in (("gen1x1", False), ("gen3x4", True)):
        rig = f"cuda:0=H200/8GiB@{link},cpu:0=100GiB"
        rc, r = plan(capsys, *MOE35, "--rig", rig, "--experts-on", "host")
        gpu, cpu = r["devices"]
        assert rc == 0 and r["chunk"] == 2048 and cpu["expert_stream_min_tokens"] is None
        assert gpu["expert_stream_min_tokens"] == stream_min_tokens(layer, LINKS[link])
        assert (gpu["expert_stream_min_tokens"] <= 2048) == streams
        main(["plan", *MOE35, "--rig", rig, "--experts-on", "host"])
        out = capsys.readouterr().out
        said = "are streamed to it" if streams else "stay on the CPU"
        assert f"in prefill runs of 2,048 tokens its host-RAM experts {said}" in out
        assert f"streaming wins from {gpu['expert_stream_min_tokens']:,} tokens" in out


def test_experts_on_auto_fills_the_card_first(capsys):
    rc, r = plan(capsys, *MOE35, "--rig", "cuda:0=P104-100,cpu:0=32GiB", "--experts-on", "auto")
    assert rc == 0 and r["fits"]
    kept = 40 - len(r["experts"])
    assert 0 < kept < 40 and set(r["experts"]) == {f"blk.{i}" for i in range(kept, 40)}
    gpu, cpu = r["devices"]
    assert gpu["parts"][:kept + 1] == ["embed"] + [f"blk.{i}" for i in range(kept)]
    assert gpu["planned_bytes"] <= gpu["capacity_bytes"] - r["reserve_bytes"]
    assert cpu["parts"] == [f"blk.{i}.experts" for i in range(kept, 40)]


def test_experts_on_n_keeps_the_first_n_layers_experts(capsys):
    rc, r = plan(capsys, *MOE35, "--rig", "cuda:0=24GiB,cpu:0=32GiB", "--experts-on", "10")
    assert rc == 0 and r["experts"] == {f"blk.{i}": "cpu:0" for i in range(10, 40)}
    with pytest.raises(SystemExit) as exc:
        main(["plan", *MOE35, "--rig", "cuda:0=24GiB,cpu:0=32GiB", "--experts-on", "gpu"])
    assert exc.value.code == 2 and "is not understood" in capsys.readouterr().err


def test_host_expert_decode_prediction_follows_the_h200_measurement(capsys):
    """35B-A3B Q4_K on an H200 capped at 8 GiB, 30 layers' experts in host RAM, their decode calls
    posted to the expert pool: measured 90.4 / 87.0 tokens/s (docs/BENCHMARKS.md v24, mean 88.7); the
    plan's prediction within 15% (91.8 when this was written)."""
    rc, r = plan(capsys, "--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--rig",
                 "cuda:0=H200/8GiB@gen5x16,cpu:0=100GiB", "--experts-on", "auto")
    assert rc == 0 and r["fits"] and len(r["experts"]) == 30
    assert r["predicted"]["decode_tokens_per_s"] == pytest.approx(88.7, rel=0.15)


@pytest.mark.parametrize("link, measured", [("gen3x4", 585.6), ("gen1x1", 97.8)])
def test_host_expert_prefill_prediction_follows_the_simulated_links(capsys, link, measured):
    """The same model and cap behind simulated PCIe links (docs/BENCHMARKS.md v25, `minecart bench
    --experts-link`): Gen3 x4 streams the experts of its 2,048-token runs at 99% of the link, 585.6
    tokens/s of a 4K prompt; behind Gen1 x1 a 2,048-token run stays on the CPU, 97.8 tokens/s. The
    plan's prefill within 15% (593.7 and 96 when this was written)."""
    rc, r = plan(capsys, "--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--rig",
                 f"cuda:0=H200/8GiB@{link},cpu:0=100GiB", "--experts-on", "auto")
    assert rc == 0 and r["fits"] and len(r["experts"]) == 30
    assert r["predicted"]["prefill_tokens_per_s"] == pytest.approx(measured, rel=0.15)


def test_a_plan_with_moe_layers_on_the_cpu_names_the_faster_experts_plan(capsys):
    """Without --experts-on, a 35B-A3B on one 8 GiB card splits its layers onto the CPU; the table is
    followed by the experts-in-host-RAM plan's decode speed and how many times faster it is, which
    --experts-on auto then plans. A dense model, or a plan with no layer on the CPU, gets no such line."""
    rig = ["--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--rig", "cuda:0=P104-100,cpu:0=64GiB"]
    assert main(["plan", *rig]) == 0
    err = capsys.readouterr().err
    rc, plain = plan(capsys, *rig)
    rc_auto, auto = plan(capsys, *rig, "--experts-on", "auto")
    assert rc == rc_auto == 0 and any(d["name"] == "cpu:0" and d["parts"] for d in plain["devices"])
    slow, fast = plain["predicted"]["decode_tokens_per_s"], auto["predicted"]["decode_tokens_per_s"]
    assert "faster: --experts-on auto" in err and f"decode {fast:.1f} tokens/s, {fast / slow:.1f}x" in err
    for other in (["--shape", "qwen3.5-9b", "--quant", "q4_k", "--rig", "cuda:0=P104-100,cpu:0=64GiB"],
                  ["--shape", "qwen3.6-35b-a3b", "--quant", "q4_k", "--rig", "cuda:0=H200,cpu:0=64GiB"]):
        assert main(["plan", *other]) == 0
        assert "faster:" not in capsys.readouterr().err
