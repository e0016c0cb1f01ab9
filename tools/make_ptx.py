"""Build the compute_61 and compute_70 PTX directories for `bash tools/gpu_runner.sh ptx`, here, before
the device call (the lent GPU machine's CuPy has NVRTC 13, which cannot target sm_61/sm_70; this machine
has the NVRTC 12 wheel that kernels/check.py uses):

    python tools/make_ptx.py [--out .gpu] [--arch compute_61 --arch compute_70] [--jobs N]

Writes OUT/ptx.tar.xz holding ptx61/ and ptx70/ (each `python -m minecart.kernels.check --emit-ptx DIR
--arch compute_XX`: every module and instantiation of kernels/build.py's registry, and the name map
kernels.json). The raw PTX (~8.5 MB per architecture) would push the carried .gpu/ folder past the 64 MiB
a device call can carry, so only the xz archive stays in OUT; the runner unpacks it on the device.
Prints the sizes and fails when OUT as a whole is over --budget-mib. Run it again after any kernel
edit: on the device, a module whose sources changed since this run fails with a clear "rebuild" error
(kernels/build.py compares a digest of the sources).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu", help="folder for ptx.tar.xz (default .gpu)")
    ap.add_argument("--arch", action="append", help="compute_XX to build (repeatable; default compute_61 and "
                                                    "compute_70)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel NVRTC compilations (default 2)")
    ap.add_argument("--budget-mib", type=float, default=62.0,
                    help="fail when OUT holds more than this many MiB afterwards (default 62: a device call "
                         "carries 64 MiB)")
    a = ap.parse_args(argv)
    from minecart.kernels import check

    archs = a.arch or ["compute_61", "compute_70"]
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="minecart-ptx-") as tmp:
        names = []
        raw = 0
        for arch in archs:
            sm = check.normalize_arch(arch)
            name = "ptx" + sm.split("_")[1]
            status = check.emit_ptx(Path(tmp) / name, sm, jobs=a.jobs)
            if status != 0:
                print(f"error: emitting {arch} PTX failed (status {status})", file=sys.stderr)
                return status
            names.append(name)
            raw += _dir_bytes(Path(tmp) / name)
        archive = out / "ptx.tar.xz"
        part = out / "ptx.tar.xz.part"
        subprocess.run(["tar", "-cJf", str(part), "-C", tmp, *names], check=True,
                       env={**os.environ, "XZ_OPT": os.environ.get("XZ_OPT", "-T0")})
        part.replace(archive)
    for name in names:  # raw PTX left by an earlier run would ride along in the carry
        shutil.rmtree(out / name, ignore_errors=True)
    total = _dir_bytes(out)
    print(f"{archive}: {archive.stat().st_size / 2**20:.2f} MiB ({raw / 2**20:.1f} MiB of PTX, "
          f"{', '.join(names)}); {out} holds {total / 2**20:.1f} MiB")
    if total > a.budget_mib * 2**20:
        print(f"error: {out} is {total / 2**20:.1f} MiB, over the {a.budget_mib:.0f} MiB budget of a device "
              "call's carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
