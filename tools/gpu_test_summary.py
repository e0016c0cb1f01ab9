"""What a GPU test run got through, file by file, from its `pytest -v` log, even when the run was cut off
by its time limit (tools/gpu_runner.sh prints this after `tests` and `ptx`):

    python3 tools/gpu_test_summary.py LOG FILE...

FILE...: the test files the run was given, in its order. Prints one line per file: its passed, failed,
error and skipped counts; "cut off in TEST" for the test that had started when the log ends without its
result; "not reached" for the files after it (and for a file whose tests a -k deselected). A device
call that ran past its limit then says which files to run in the next one. Exit status 0 when every given file ran to the end with no failure or
error, else 1.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# `pytest -v` writes a test's node id, then (with -s) whatever the test printed, then its outcome; a
# failure in a fixture's teardown adds a second "ERROR" for a test that already has one outcome
_NODE = re.compile(r"^(tests/\S+?\.py)::(\S+)", re.M)
_OUTCOME = re.compile(r"\b(" + "|".join(OUTCOMES) + r")\b")


@dataclass
class FileResult:
    path: str
    counts: dict[str, int] = field(default_factory=dict)
    cut_off: str | None = None  # the test that started and has no outcome in the log

    @property
    def ran(self) -> bool:
        return bool(self.counts) or self.cut_off is not None

    def line(self) -> str:
        if not self.ran:
            return f"{self.path}: not reached"
        parts = [f"{self.counts.get(o, 0)} {o.lower()}" for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")
                 if self.counts.get(o, 0) or o == "PASSED"]
        parts += [f"{n} {o.lower()}" for o, n in self.counts.items() if o in ("XFAIL", "XPASS")]
        tail = f"; cut off in {self.cut_off}" if self.cut_off else ""
        return f"{self.path}: {', '.join(parts)}{tail}"


def summarize(log: str, files: list[str]) -> list[FileResult]:
    """The per-file results of a `pytest -v` log of a run given `files` (in that order)."""
    results = {f: FileResult(f) for f in files}
    nodes = list(_NODE.finditer(log))
    for i, m in enumerate(nodes):
        path, test = m.group(1), m.group(2)
        res = results.setdefault(path, FileResult(path))
        # the outcome follows the node id on its line, or after the test's own output (-s)
        end = nodes[i + 1].start() if i + 1 < len(nodes) else len(log)
        found = _OUTCOME.search(log, m.end(), end)
        if found is None:
            if i + 1 == len(nodes):
                res.cut_off = test
            continue
        res.counts[found.group(1)] = res.counts.get(found.group(1), 0) + 1
    return list(results.values())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8", errors="replace") as f:
        log = f.read()
    results = summarize(log, args[1:])
    for r in results:
        print(r.line())
    bad = [r for r in results
           if not r.ran or r.cut_off or r.counts.get("FAILED") or r.counts.get("ERROR")]
    if bad:
        print("to run again: " + " ".join(r.path for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
