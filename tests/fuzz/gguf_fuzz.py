"""GGUF fuzzing: mutated fixture files run through the real loaders, each outcome classified.

A case is a recipe (plain JSON, so a find can be kept in tests/data/fuzz_corpus/gguf/ and replayed):
a base file and a list of operations. Structural operations edit the parsed file through `Forged`
(a metadata value retyped or set to an extreme, a tensor's dimensions, type or offset, the header
counts); byte operations act on the written bytes (bit flips, a u64 overwritten, truncation).

Bases: "mmproj" (the fixture vision projector, loaded with `load_vision`) and "text" (the fixture
dense model cut to a 1024-token vocabulary so a case takes milliseconds, loaded with `load_model` on
the CPU, then its tokenizer and chat template used once).

Outcomes: "loaded" (the loaders accepted the file), "clean" (a MinecartError), "raw" (any other
exception, or the worker process died), "hang" (past the per-case time limit), "over_memory" (a
MemoryError under the address-space limit, or a traced peak past it). Cases run in a worker process
(`python -m tests.fuzz.gguf_fuzz`) under an address-space limit, so a hostile allocation fails there
instead of taking the test run down; a worker that dies is restarted after the case that killed it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fuzz.gguf_forge import TYPE_IDS, Forged

REPO = Path(__file__).resolve().parents[2]
BASES = {"mmproj": "vision/mmproj-qwen35-tiny-vl-f16.gguf", "text": "dense/qwen35-tiny-dense-q8_0.gguf"}
SMALL_VOCAB = 1024
OUTCOMES = ("clean", "loaded", "raw", "hang", "over_memory")
CASE_TIME_LIMIT_S = 10.0  # a chat template alone may use its 1 s render budget
MEMORY_LIMIT_BYTES = 1 << 30  # on top of what the worker holds after its imports

# Values a forged field takes: the edges of every integer width, wrong kinds, empties.
_EXTREME_INTS = [0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 3, 4096, 10**9]
_WRONG_VALUES: list[tuple[int, Any]] = [
    (TYPE_IDS["STRING"], ""), (TYPE_IDS["STRING"], "x" * 1000), (TYPE_IDS["FLOAT32"], 1.5),
    (TYPE_IDS["FLOAT32"], float("nan")), (TYPE_IDS["FLOAT64"], float("inf")), (TYPE_IDS["BOOL"], True),
    (TYPE_IDS["INT32"], -1), (TYPE_IDS["UINT64"], 2**64 - 1), (TYPE_IDS["UINT32"], 0),
    (TYPE_IDS["ARRAY"], (TYPE_IDS["UINT32"], [])), (TYPE_IDS["ARRAY"], (TYPE_IDS["FLOAT32"], [1.0] * 4)),
    (TYPE_IDS["ARRAY"], (TYPE_IDS["STRING"], ["a", "b"])), (TYPE_IDS["ARRAY"], (TYPE_IDS["INT8"], [1, 2, 3])),
]


@dataclass(frozen=True)
class Outcome:
    case: int
    outcome: str
    detail: str
    seconds: float
    peak_bytes: int


# ---------------------------------------------------------------------------------------------------
# recipes


def random_recipe(rng: random.Random, base: str, forged: Forged) -> dict:
    """One mutation recipe of `base` (whose parsed form is `forged`): 1 to 3 operations."""
    ops: list[list[Any]] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        kind = rng.choice(("set", "set", "set", "tensor", "tensor", "header", "flip", "flip", "u64",
                           "truncate"))
        if kind == "set":
            key = rng.choice([k for k, _, _ in forged.kv])
            if rng.random() < 0.5:
                type_id, value = rng.choice(_WRONG_VALUES)
            else:
                type_id, value = TYPE_IDS["UINT32"], rng.choice(_EXTREME_INTS[:5])
                if value >= 2**32:
                    type_id = TYPE_IDS["UINT64"]
            if isinstance(value, tuple):
                value = [value[0], value[1]]
            ops.append(["set", key, type_id, value])
        elif kind == "tensor":
            t = rng.choice(forged.tensors)
            field = rng.choice(("ne", "ne", "type", "offset"))
            if field == "ne":
                ne = list(t.ne)
                ne[rng.randrange(len(ne))] = rng.choice(_EXTREME_INTS)
                if rng.random() < 0.2:
                    ne = ne + [rng.choice(_EXTREME_INTS)]
                ops.append(["tensor", t.name, "ne", ne])
            elif field == "type":
                ops.append(["tensor", t.name, "type", rng.choice((0, 1, 8, 12, 30, 39, 2**31))])
            else:
                ops.append(["tensor", t.name, "offset", rng.choice((0, 32, 2**40, 2**64 - 32, 7))])
        elif kind == "header":
            field = rng.choice(("n_tensors", "n_kv", "version"))
            values = (0, 1, 2, 4, 2**31, 2**32 - 1) + ((2**63, 2**64 - 1) if field != "version" else ())
            ops.append(["header", field, rng.choice(values)])
        elif kind == "flip":
            # mostly in the header and metadata, where a flip changes meaning
            span = min(len(forged.to_bytes_cached()), 1 << 16) if rng.random() < 0.8 else None
            ops.append(["flip", rng.randrange(span or len(forged.to_bytes_cached())), rng.randrange(8)])
        elif kind == "u64":
            ops.append(["u64", rng.randrange(8, 1 << 14), rng.choice(_EXTREME_INTS)])
        else:
            ops.append(["truncate", rng.randrange(len(forged.to_bytes_cached()))])
    return {"base": base, "ops": ops}


def build(recipe: dict, forged: Forged) -> bytes:
    """The bytes of a recipe applied to a (fresh copy of) its parsed base."""
    f = Forged(kv=list(forged.kv), tensors=[_copy_tensor(t) for t in forged.tensors], data=forged.data,
               alignment=forged.alignment)
    byte_ops = []
    for op in recipe["ops"]:
        if op[0] == "set":
            value = op[3]
            f.set(op[1], op[2], (value[0], value[1]) if op[2] == TYPE_IDS["ARRAY"] else value)
        elif op[0] == "tensor":
            t = next((t for t in f.tensors if t.name == op[1]), None)
            if t is not None:
                setattr(t, {"ne": "ne", "type": "ggml_type", "offset": "offset"}[op[2]], op[3])
        elif op[0] == "header":
            setattr(f, op[1], op[2])
        else:
            byte_ops.append(op)
    raw = bytearray(f.to_bytes())
    for op in byte_ops:
        if op[0] == "flip" and op[1] < len(raw):
            raw[op[1]] ^= 1 << op[2]
        elif op[0] == "u64" and op[1] + 8 <= len(raw):
            raw[op[1]:op[1] + 8] = struct.pack("<Q", op[2] & (2**64 - 1))
        elif op[0] == "truncate":
            del raw[op[1]:]
    return bytes(raw)


def _copy_tensor(t):
    from tests.fuzz.gguf_forge import Tensor

    return Tensor(t.name, list(t.ne), t.ggml_type, t.offset)


def load_base(name: str, fixtures: Path) -> Forged:
    f = Forged.from_file(fixtures / BASES[name])
    if name == "text":  # a 1024-token vocabulary: the same model, parsed in milliseconds
        for key, type_id, value in list(f.kv):
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                f.set(key, type_id, (value[0], value[1][:SMALL_VOCAB]))
            elif key == "tokenizer.ggml.merges":
                f.set(key, type_id, (value[0], value[1][:2000]))
            elif key.endswith("_token_id") and isinstance(value, int) and value >= SMALL_VOCAB:
                f.drop(key)
        for t in f.tensors:
            if t.name in ("token_embd.weight", "output.weight"):
                t.ne = [t.ne[0], SMALL_VOCAB]
    return f


def random_recipes(n: int, seed: int, fixtures: Path, text_share: float = 0.35) -> list[dict]:
    rng = random.Random(seed)
    bases = {name: load_base(name, fixtures) for name in BASES}
    return [random_recipe(rng, base, bases[base])
            for base in ("text" if rng.random() < text_share else "mmproj" for _ in range(n))]


# ---------------------------------------------------------------------------------------------------
# running


def open_with_loaders(path: Path) -> None:
    """What minecart does with a file it is given: the real loaders, end to end."""
    from minecart.engine.gguf_file import GGUFFile

    with GGUFFile(path) as gf:
        arch = gf.get("general.architecture")
    if arch == "clip":
        from minecart.engine.vision.mmproj import load_vision

        load_vision(path).close()
        return
    from minecart.engine import load_model

    model = load_model(path, devices=["cpu:0"])
    tok = model.tokenizer
    if tok is not None:
        tok.decode(tok.encode("Hello, world"))
    template = model.chat_template
    if template is not None:
        template.render([{"role": "user", "content": "hi"}])


class _Hang(BaseException):
    pass


def _alarm(_signum, _frame):
    raise _Hang


def run_one(i: int, recipe: dict, bases: dict[str, Forged], folder: Path) -> Outcome:
    from minecart.engine.errors import MinecartError

    path = folder / f"case-{i}.gguf"
    path.write_bytes(build(recipe, bases[recipe["base"]]))
    tracemalloc.start()
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, CASE_TIME_LIMIT_S)
    try:
        open_with_loaders(path)
        outcome, detail = "loaded", ""
    except _Hang:
        outcome, detail = "hang", f"past {CASE_TIME_LIMIT_S} s"
    except MemoryError:
        outcome, detail = "over_memory", "MemoryError"
    except MinecartError as exc:
        outcome, detail = "clean", f"{type(exc).__name__}: {str(exc)[-160:]}"
    except BaseException as exc:  # the finding: anything else
        outcome, detail = "raw", f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        path.unlink()
    if outcome in ("loaded", "clean") and peak > MEMORY_LIMIT_BYTES:
        outcome, detail = "over_memory", f"traced peak {peak} bytes"
    return Outcome(i, outcome, detail, seconds, peak)


def _worker() -> None:
    """Runs the recipes of a JSON-lines file from a start index; one Outcome per line on stdout."""
    logging.disable(logging.WARNING)
    recipes_file, start, fixtures = Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    import minecart.engine  # noqa: F401 - imports before the limit is measured
    from minecart.engine import load_model  # noqa: F401
    from minecart.engine.vision.mmproj import load_vision  # noqa: F401

    bases = {name: load_base(name, fixtures) for name in BASES}
    for b in bases.values():
        b.to_bytes_cached()
    with open("/proc/self/statm") as fh:
        vm_bytes = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + MEMORY_LIMIT_BYTES, resource.RLIM_INFINITY))
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="minecart-fuzz-") as tmp, open(recipes_file) as fh:
        for i, line in enumerate(fh):
            if i >= start:
                out = run_one(i, json.loads(line), bases, Path(tmp))
                print(json.dumps(out.__dict__), flush=True)


def run_cases(recipes: list[dict], fixtures: Path) -> list[Outcome]:
    """Every recipe through a worker process; a worker that dies marks its case "raw" (the process
    died) and a new worker goes on with the next case."""
    outcomes: list[Outcome] = []
    start = 0
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    with tempfile.TemporaryDirectory(prefix="minecart-fuzz-") as tmp:
        recipes_file = Path(tmp) / "recipes.jsonl"
        recipes_file.write_text("".join(json.dumps(r) + "\n" for r in recipes))
        while start < len(recipes):
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.fuzz.gguf_fuzz", "worker", str(recipes_file), str(start),
                 str(fixtures)], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                outcomes.append(Outcome(**json.loads(line)))
            proc.wait()
            done = outcomes[-1].case + 1 if outcomes and outcomes[-1].case >= start else start
            if done < len(recipes):
                outcomes.append(Outcome(done, "raw", f"the worker died (exit {proc.returncode})", 0.0, 0))
                done += 1
            start = done
    return outcomes


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c = Counter(o.outcome for o in outcomes)
    return {k: c.get(k, 0) for k in OUTCOMES}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _worker()
