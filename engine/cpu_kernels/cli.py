"""`tandem kernels`: build the CPU kernels at install time, and say which build this
machine loads.

    tandem kernels build                 every x86-64 build (amx, avx512_bf16, avx512, avx2):
                                         an image made here runs on any of those CPUs
    tandem kernels build --only-runnable the builds this CPU runs (a quicker local install)
    tandem kernels info                  this CPU's flags, the builds it runs, the one a
                                         worker loads, and which are built
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from engine.cpu_kernels import isa


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help="build the CPU kernels (an install step), or show which build loads here",
                       description="tandem's CPU kernels come as one build per instruction set; a worker loads the "
                       "best one its CPU runs (TANDEM_CPU_KERNELS names another).")
    s = p.add_subparsers(dest="kernels_command", required=True)
    b = s.add_parser("build", help="compile the builds (once, at install)")
    b.add_argument("--variants", default=None,
                   help="comma-separated builds to make (default: all of this architecture's: "
                   f"{','.join(v.name for v in isa.INSTALLED)})")
    b.add_argument("--only-runnable", action="store_true", help="only the builds this CPU runs")
    b.add_argument("--into", type=Path, default=None,
                   help=f"where to put them (default {isa.PREBUILT_DIR}, or the cache directory when that is "
                   "read-only)")
    b.set_defaults(func=run_build)
    i = s.add_parser("info", help="this CPU's flags and the build a worker loads")
    i.set_defaults(func=run_info)
    return p


def _root(into: Path | None) -> Path:
    from engine.cpu_kernels import build

    if into is not None:
        return into
    try:
        build.PREBUILT_DIR.mkdir(parents=True, exist_ok=True)
        probe = build.PREBUILT_DIR / ".writable"
        probe.write_text("")
        probe.unlink()
        return build.PREBUILT_DIR
    except OSError:
        return build.prebuilt_roots()[-1]


def _remove_stale(root: Path) -> int:
    """Remove builds in `root` that no current source, flag set and torch would load."""
    import shutil

    from engine.cpu_kernels import build

    current = {build.extension_name(v) for v in build.VARIANTS}
    stale = [d for d in root.glob("tandem_cpu_*") if d.is_dir() and d.name not in current] if root.is_dir() else []
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return len(stale)


def run_build(args) -> int:
    from engine.cpu_kernels import build  # torch: only when the command runs

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.variants:
        try:
            wanted = [build.variant(n.strip()) for n in args.variants.split(",") if n.strip()]
        except build.KernelBuildError as e:
            print(f"tandem kernels build: {e}", file=sys.stderr)
            return 2
    else:
        wanted = list(build.INSTALLED)
    if args.only_runnable:
        runs = build.runnable()
        wanted = [v for v in wanted if v in runs] or runs[:1]
    root = _root(args.into)
    stale = _remove_stale(root)
    if stale:
        print(f"removed {stale} build(s) of other sources or another torch from {root}")
    t0 = time.perf_counter()
    for v in wanted:
        try:
            binary = build.compile_variant(v, root)
        except build.KernelBuildError as e:
            print(f"tandem kernels build: {e}", file=sys.stderr)
            return 1
        print(f"{v.name:12s} {binary}")
    print(f"{len(wanted)} build(s) in {time.perf_counter() - t0:.0f} s")
    return 0


def run_info(args) -> int:
    from engine.cpu_kernels import build

    print(f"cpu: {isa.cpu_model()}")
    print(f"flags: {' '.join(isa.isa_flags())}")
    runs = build.runnable()
    try:
        v, why = build.chosen()
        print(f"loads: {v.name} ({v.describe}; {why})")
    except build.KernelBuildError as e:
        print(f"loads: none ({e})")
    for v in build.VARIANTS:
        name = build.extension_name(v)
        where = next((str(r / name) for r in build.prebuilt_roots() if (r / name / f"{name}.so").exists()), "not built")
        print(f"  {v.name:12s} {'runs' if v in runs else 'no  '}  {where}")
    return 0
