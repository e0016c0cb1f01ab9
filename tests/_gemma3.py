"""A tiny random-weight Gemma 3 GGUF (written with gguf-py's GGUFWriter), for the tests that need a
Gemma 3 file without the demo package: 7 layers (the 6th attends globally, the rest through an 8-token
sliding window, so a 40-token prompt exercises the window; head dim 64, one the GPU attention kernels
take), F16 projections, F32 norms, no tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW = 512, 128, 4, 2, 64, 256, 7, 8


def tiny_gemma3_file(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_context_length(4096)
    w.add_feed_forward_length(FFN)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_rope_freq_base(1_000_000.0)

    def mat(rows: int, cols: int, scale: float = 0.7) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float16)

    def norm(n: int) -> np.ndarray:  # stored as 1 + w (the converter's form)
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, HIDDEN)) * 0.05).astype(np.float16))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "attn_q.weight", mat(HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_k.weight", mat(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_v.weight", mat(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_output.weight", mat(HIDDEN, HEADS * HEAD_DIM, 0.3))
        w.add_tensor(p + "post_attention_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", mat(HIDDEN, FFN, 0.3))
        w.add_tensor(p + "post_ffw_norm.weight", norm(HIDDEN))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
