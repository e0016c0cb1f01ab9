"""Choosing the next token from a row of logits: penalties, temperature, top-k, top-p, min-p, seed.

Runs on the host in float64 over one (vocab,) row per step. Order of operations (as transformers and
vLLM do it): penalties on the raw logits, then temperature, then the top-k / top-p / min-p filters on
the tempered distribution, then one draw. temperature == 0 means greedy: argmax after the penalties
(lowest id wins a tie), no randomness.

Penalties:
- repetition_penalty (transformers / CTRL style) over every token of the prompt and the output so far:
  a seen token's logit is divided by the penalty when positive, multiplied when negative;
- presence_penalty and frequency_penalty (OpenAI style) over the generated tokens only:
  logit -= presence * [count > 0] + frequency * count.

What this file is not: the generate loop (generation.py) or stop handling.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow Qwen3.5's non-thinking recommendation."""

    temperature: float = 0.7
    top_k: int = 20  # 0 = off
    top_p: float = 0.8  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 2048
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)  # stop strings (not shown)
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)  # besides the model's EOS

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min_p must be in [0, 1)")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0 (1 = off)")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_params(**overrides) -> SamplingParams:
    """Deterministic argmax decoding (tests, benchmarks)."""
    return SamplingParams(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, **overrides})


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids=(), generated_ids=()) -> np.ndarray:
    """A float64 copy of `logits` with the penalties applied."""
    out = np.array(logits, dtype=np.float64)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.fromiter((*prompt_ids, *generated_ids), dtype=np.int64))
        if seen.size:
            vals = out[seen]
            out[seen] = np.where(vals > 0, vals / params.repetition_penalty,
                                 vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated_ids):
        counts = Counter(int(t) for t in generated_ids)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float64)
        out[ids] -= params.presence_penalty + params.frequency_penalty * n
    return out


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a draw uses: softmax(logits / T) restricted by top-k, top-p and min-p,
    renormalized. float64 (vocab,)."""
    x = np.asarray(logits, np.float64) / params.temperature
    keep = np.ones(x.shape, dtype=bool)
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, x.size - params.top_k)[x.size - params.top_k]
        keep &= x >= kth
    x = np.where(keep, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        n_keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        drop = order[n_keep:]
        p[drop] = 0.0
    if params.min_p > 0.0:
        p[p < params.min_p * p.max()] = 0.0
    return p / p.sum()


class Sampler:
    """Stateful sampler for one generation: remembers the prompt, the output so far and the RNG."""

    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.generated: list[int] = []
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Pick the next token from a (vocab,) row and remember it."""
        token = self.pick(logits)
        self.generated.append(token)
        return token

    def pick(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits).reshape(-1)
        x = apply_penalties(logits, self.params, self.prompt_ids, self.generated)
        if self.params.greedy:
            return int(np.argmax(x))
        p = filtered_probs(x, self.params)
        # inverse-CDF draw: one uniform number per step, reproducible for a seed
        u = self.rng.random()
        idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
        nonzero = np.flatnonzero(p)
        return int(min(max(idx, nonzero[0]), nonzero[-1]))
