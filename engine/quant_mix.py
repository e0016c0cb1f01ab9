"""The GGML types of a model's matrices for a quant name: one type for every matrix (`q4_k`), or one of
llama-quantize's mixes (`q4_k_m`, `q5_k_m`), each with llama-quantize's fallback for rows too narrow
for a 256-value block. `minecart synth` writes files of these types (engine/synth.py) and `minecart
plan --shape --quant` prices them (engine/placement.py config_and_tensors_for_shape).
tests/engine/test_synth_mixes.py checks the mixes tensor by tensor against llama-quantize itself."""

from __future__ import annotations

from dataclasses import dataclass

from . import quants as Q
from .errors import RequestError

# quant name -> ggml type id
QUANTS = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
          "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K,
          "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS}
# general.file_type (llama.cpp LlamaFileType) of a file whose matrices are all of one type
FILE_TYPE = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.Q5_0: 8, Q.Q5_1: 9, Q.Q4_K: 14,
              Q.Q5_K: 16, Q.Q6_K: 18, Q.BF16: 32, Q.IQ4_NL: 25, Q.IQ4_XS: 30}
# llama-quantize's fallback when a row is not a whole number of 256-value K blocks
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}


@dataclass(frozen=True)
class Mix:
    """One of llama-quantize's K-quant mixes, the files people download most (`Q4_K_M`, `Q5_K_M`): most
    matrices in `base`, and Q6_K where the mix spends more bits. For the tensors of this project's
    architectures its rules come down to:
    - output.weight (token_embd.weight when the embeddings are tied) is Q6_K, or Q8_0 when its rows are
      not a whole number of 256-value blocks;
    - attn_v and the Gated DeltaNet's fused attn_qkv, counted together in file order (i of n), are Q6_K
      where `more_bits(i, n)`;
    - ffn_down of layer i of n blocks (MTP blocks counted; routed and shared experts alike) is Q6_K
      where `more_bits(i, n)`;
    - everything else is `base`; a row too narrow for a 256-value block falls back as it does for a
      single type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0)."""

    base: int
    file_type: int  # general.file_type (llama.cpp's LlamaFileType)

    @staticmethod
    def more_bits(i: int, n: int) -> bool:
        """The first and last eighth of the layers, and every third one between them."""
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def types(self, names: list[str], n_blocks: int) -> list[int]:
        """The type this mix gives each matrix of `names` (in file order), before the row-width fallback."""
        attn_v = {n: i for i, n in enumerate(n for n in names if n.endswith(("attn_v.weight", "attn_qkv.weight")))}
        tied = "output.weight" not in names
        out = []
        for name in names:
            if name == "output.weight" or (tied and name == "token_embd.weight"):
                out.append(Q.Q6_K)
            elif name in attn_v:
                out.append(Q.Q6_K if self.more_bits(attn_v[name], len(attn_v)) else self.base)
            elif "ffn_down" in name:
                layer = int(name.split(".")[1])
                out.append(Q.Q6_K if self.more_bits(layer, n_blocks) else self.base)
            else:
                out.append(self.base)
        return out


MIXES = {"q4_k_m": Mix(Q.Q4_K, 15), "q5_k_m": Mix(Q.Q5_K, 17)}  # llama-quantize's Q4_K_M, Q5_K_M
QUANT_NAMES = [*QUANTS, *MIXES]  # what `--quant` takes


def parse_quant(quant: str | int | Mix) -> int | Mix:
    """A quant name (any case: "q4_k", "Q4_K_M") as a GGML type id or a Mix; ids and Mixes pass through."""
    if isinstance(quant, Mix):
        return quant
    if isinstance(quant, str):
        name = quant.lower()
        if name not in QUANT_NAMES:
            raise RequestError(f"unknown quant type '{quant}'; choose one of {', '.join(QUANT_NAMES)}")
        return MIXES[name] if name in MIXES else QUANTS[name]
    return int(quant)


def file_type(quant: int | Mix) -> int:
    """general.file_type of a file of these types."""
    return quant.file_type if isinstance(quant, Mix) else FILE_TYPE[quant]


def matrix_type(type_id: int, n_in: int) -> int:
    """type_id for a matrix of rows of n_in values, or llama-quantize's fallback where the rows are not
    whole blocks of it (Q4_K -> Q5_0 ...; F16 where no fallback fits)."""
    if n_in % Q.BLOCK_SIZES[type_id][0] == 0:
        return type_id
    fallback = K_FALLBACK.get(type_id)
    if fallback is not None and n_in % Q.BLOCK_SIZES[fallback][0] == 0:
        return fallback
    return Q.F16


def matrix_types(matrices: list[tuple[str, int]], n_blocks: int, quant: int | Mix) -> dict[str, int]:
    """name -> GGML type of each matrix (name, row length), given in file order, of a model of n_blocks
    blocks (MTP blocks counted, as llama-quantize counts them)."""
    names = [name for name, _ in matrices]
    picked = quant.types(names, n_blocks) if isinstance(quant, Mix) else [quant] * len(names)
    return {name: matrix_type(t, n_in) for (name, n_in), t in zip(matrices, picked, strict=True)}
