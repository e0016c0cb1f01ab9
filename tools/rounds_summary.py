"""The best time of each measured line per tree, from a log of tools/gpu_runner.sh's steps or matmuls mode
(trees alternated for some rounds), with its ratio to the first older tree's (t1):

    python3 tools/rounds_summary.py LOG

LOG lines are "round R tree TREE | LINE", LINE a measurement whose first "<number> ms" is its time and
whose text before it names it: a bench_gemv step line such as "Q4_K: GEMV time of a 9B decode step of
8 sequences (auto) 2.718 ms, 0.340 ms per sequence", or the steps mode's "batch 1 context 64 2.1883 ms
GPU, 2.31 ms wall"; "rc ..." for a run that failed. Prints, for each line in the order first seen, one
row per tree: the best (lowest) time over the rounds, and for trees other than t1 the ratio to
t1's. Exit status 1 when a run failed or the log holds no measurement, else 0.
"""

from __future__ import annotations

import re
import sys

_ROW = re.compile(r"^round (\d+) tree (\S+) \| (.*)$")
_STEP = re.compile(r"^(.*?) ([0-9.]+) ms\b")


def summarize(lines: list[str]) -> tuple[list[str], bool]:
    """(the printed rows, whether every run succeeded and some step line was seen)."""
    best: dict[str, dict[str, float]] = {}
    trees: list[str] = []
    ok = True
    for line in lines:
        m = _ROW.match(line.strip())
        if not m:
            continue
        tree, rest = m.group(2), m.group(3)
        if tree not in trees:
            trees.append(tree)
        if rest.startswith("rc "):
            ok = False
            continue
        s = _STEP.match(rest)
        if not s:
            continue
        key = " ".join(s.group(1).split())
        per = best.setdefault(key, {})
        per[tree] = min(per.get(tree, float("inf")), float(s.group(2)))
    order = [t for t in trees if t == "this"] + [t for t in trees if t != "this"]
    rows = []
    for key, per in best.items():
        ref = per.get("t1")
        for tree in order:
            if tree in per:
                ratio = f"  vs t1 {per[tree] / ref:.3f}" if ref and tree != "t1" else ""
                rows.append(f"{key} | {tree:<5} best {per[tree]:.3f} ms{ratio}")
    return rows, ok and bool(best)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows, ok = summarize(f.read().splitlines())
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
