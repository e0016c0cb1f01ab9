"""Decode speed as a user of the generate loop sees it, against the bare step loop of `minecart bench`.

`minecart bench` times `Session.step` back to back: the device's speed. A chat, the CLI and the server
go through `generate` (engine/generation.py): a pick by the sampler, the text of the token, stop
strings, an event, and the consumer's own work on it (a Qt signal, a line on the terminal, a
server-sent event). This prints, for the same model and prompt: the bare step loop's tokens/s, then
`generate`'s decode tokens/s with greedy picks, sampled picks (temperature 0.7, top-k 20, top-p 0.8,
a fixed seed) and the app's default picks (resources/default_settings.json: temperature 0.7, top-k 40,
top-p 0.9, min-p 0.05, repetition penalty 1.05), each with a consumer that takes nothing and one that busies its thread for
`--consumer-us` microseconds per token (a stand-in for a server's or an app's work on each event).

    python3 tools/bench_generate.py MODEL.gguf [--device cuda:0] [--tokens 256] [--consumer-us 100]
        [--scheduler N [--batched-steps]]

--scheduler N runs the loops through a Scheduler with N slots (`minecart serve --parallel N`), one
request at a time: a generation running alone launches its own steps (Scheduler.alone);
--batched-steps makes every step go through the scheduler's thread, as before that.

--concurrent C (with --scheduler N >= C, default C) runs C generations at once through the scheduler,
each on its own random prompt, for each sampler, and prints their aggregate decode tokens/s while all C
decode (from the last one's first token to the first one's last) and how many rows were chained passes
(the scheduler drew their token itself); --unchained-passes makes every batched generation pick its
token before asking for its next pass, as before those.

--stub-step-ms MS (with --concurrent) measures the host's share alone: every batched step is replaced
by a wait of MS milliseconds (the interpreter released, as while a device computes) that
returns random top logits, and the rates are printed against C / MS, what the generations would get if
the host took no time between steps. Runs on any device, the CPU included.

What this is not: a benchmark with ceilings (`minecart bench` is).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
from minecart.engine import load_model
from minecart.engine.generation import generate
from minecart.engine.sampling import LaunchedStep, SamplingParams, TopLogits, greedy_params
from minecart.engine.scheduler import BatchedModel, Scheduler


class _BatchedSteps(Scheduler):
    """A scheduler whose lone generation's steps go through its thread too (--batched-steps)."""

    def alone(self) -> bool:
        return False


class _UnchainedPasses(BatchedModel):
    """A scheduler's view whose batched generations hand in no pass before they picked its token
    (--unchained-passes)."""

    def launch_next(self, states, positions, top, pick):
        return super().launch_next(states, positions, top, pick) if self.scheduler.alone() else None


def _concurrent(sched: Scheduler, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Aggregate decode tokens/s of len(prompts) generations at once while all of them decode, and the
    chained passes among their rows."""
    times: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    chained = sched.metrics()["chained_passes"]

    def run(i: int) -> None:
        try:
            for ev in sched.generate(prompts[i], params):
                if ev.token is not None:
                    times[i].append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    n = sum(sum(1 for x in t if lo < x <= hi) for t in times)
    return (n / (hi - lo) if hi > lo else 0.0), int(sched.metrics()["chained_passes"] - chained)


def _stub_steps(model, step_s: float) -> None:
    """Replace the model's batched steps by launches that take step_s seconds (result() waits for the rest
    of them, as for a device's step) and return random top logits (whole random rows when a step asks
    for them) without an end token among them."""
    vocab = model.config.vocab_size
    eos = set(model.tokenizer.eos_ids) if model.tokenizer is not None else set()
    rng = np.random.default_rng(1)
    usable = np.array([t for t in range(min(vocab, 4096)) if t not in eos], np.int64)
    # rows of distinct usable ids, drawn once: a step takes random ones (drawing them without replacement
    # at every step took 20-30 us a row, host time that no device's step spends)
    pool = np.stack([rng.permutation(usable)[:64] for _ in range(256)])

    def launch_batch(ids, states, positions, top=0):
        end = time.perf_counter() + step_s
        B = len(ids)
        out: np.ndarray | TopLogits
        if not top:
            out = np.full((B, vocab), -30.0, np.float32)
            out[:, usable] = rng.standard_normal((B, usable.size)).astype(np.float32) * 3
        else:  # and their whole rows, as a device's step keeps them (a prompt's last row reads its own)
            vals = -np.sort(-rng.standard_normal((B, top)).astype(np.float32) * 3, axis=1)
            picks = pool[rng.integers(0, len(pool), B), :top]

            def fetch(r: int, vals=vals, picks=picks) -> np.ndarray:
                row = np.full(vocab, -30.0, np.float32)
                row[picks[r]] = vals[r]
                return row

            out = TopLogits(vals, picks, fetch=fetch)

        def result() -> np.ndarray | TopLogits:
            time.sleep(max(0.0, end - time.perf_counter()))
            return out

        return LaunchedStep(result)

    model.executor.launch_batch = launch_batch


def _bare(model, ids: list[int], n: int) -> float:
    s = model.new_session(len(ids) + n + 8)
    logits = s.prefill(ids)
    top = s.step(int(np.argmax(logits)), top=1)
    t = time.perf_counter()
    for _ in range(n):
        assert isinstance(top, TopLogits)
        top = s.step(int(top.ids[0, 0]), top=1)
    dt = time.perf_counter() - t
    s.close()
    return n / dt


def _through_generate(model, ids: list[int], params: SamplingParams, busy_s: float,
                      sched: Scheduler | None = None) -> tuple[float, int]:
    s = (model if sched is None else sched).new_session(len(ids) + (params.max_tokens or 0) + 8)
    first = last = None
    n = 0
    events = generate(model, ids, params, session=s) if sched is None else sched.generate(ids, params, session=s)
    for ev in events:
        if ev.token is None:
            continue
        n += 1
        now = time.perf_counter()
        if first is None:
            first = now
        last = now
        if busy_s:
            end = now + busy_s
            while time.perf_counter() < end:
                pass
    s.close()
    assert first is not None and last is not None
    return (n - 1) / (last - first) if n > 1 else 0.0, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--consumer-us", type=float, default=100.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--scheduler", type=int, default=0, metavar="N")
    ap.add_argument("--batched-steps", action="store_true")
    ap.add_argument("--concurrent", type=int, default=0, metavar="C")
    ap.add_argument("--unchained-passes", action="store_true")
    ap.add_argument("--stub-step-ms", type=float, default=0.0, metavar="MS")
    ap.add_argument("--samplers", default="greedy,sampled,app default",
                    help="which of greedy, sampled and app default to run (comma-separated)")
    args = ap.parse_args(argv)
    if args.stub_step_ms and not args.concurrent:
        ap.error("--stub-step-ms needs --concurrent")
    model = load_model(args.model, devices=[args.device])
    sched = None
    if args.scheduler or args.concurrent:
        sched = (_BatchedSteps if args.batched_steps else Scheduler)(
            model, parallel=max(args.scheduler, args.concurrent))
        if args.unchained_passes:
            sched.view = _UnchainedPasses(sched, model)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(1000, 50000, args.prompt)]
    if not args.stub_step_ms:
        _bare(model, ids[:64], 16)  # warm-up: kernels compiled, graphs captured
    n = args.tokens
    picks = {"greedy": greedy_params(max_tokens=n),
             "sampled": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=7, max_tokens=n),
             "app default": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.05,
                                           seed=7, max_tokens=n)}
    wanted = [name.strip() for name in args.samplers.split(",")]
    if unknown := [name for name in wanted if name not in picks]:
        ap.error(f"--samplers: unknown {unknown}; use {', '.join(picks)}")
    picks = {name: picks[name] for name in wanted}
    if args.concurrent:
        assert sched is not None
        top_id = min(50000, model.config.vocab_size)
        prompts = [[int(t) for t in rng.integers(min(1000, top_id // 2), top_id, args.prompt + i)]
                   for i in range(args.concurrent)]
        ideal = ""
        if args.stub_step_ms:
            _stub_steps(model, args.stub_step_ms / 1e3)
            ideal_tps = args.concurrent / (args.stub_step_ms / 1e3)
        for r in range(args.repeat):
            for name, params in picks.items():
                tps, chained = _concurrent(sched, prompts, params)
                if args.stub_step_ms:
                    ideal = f", {tps / ideal_tps:.3f} of the {ideal_tps:.0f} with no host time"
                print(f"run {r + 1}: {args.concurrent} at once, {name}: {tps:.1f} tok/s in all "
                      f"({chained} chained passes{ideal})", flush=True)
        sched.close()
        model.close()
        return 0
    for r in range(args.repeat):
        print(f"run {r + 1}: bare step loop {_bare(model, ids, n):.1f} tok/s", flush=True)
        for name, params in picks.items():
            for busy in (0.0, args.consumer_us):
                chained = model.executor.chained_steps
                tps, got = _through_generate(model, ids, params, busy * 1e-6, sched)
                chained = model.executor.chained_steps - chained
                print(f"  generate, {name}, consumer {busy:.0f} us/token: {tps:.1f} tok/s ({got} tokens, "
                      f"{chained} steps chained)", flush=True)
    if sched is not None:
        sched.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
