"""Which tandem this process runs: the package's version and, where known, the commit.
Torch-free (the router and the command line read it too).

The commit comes from `TANDEM_COMMIT` (container images set it at build time), else from
the git checkout the code runs from (an editable install), else it is empty."""

from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata
from pathlib import Path


@functools.cache
def build_info() -> dict[str, str]:
    try:
        version = metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        version = "unknown"
    return {"version": version, "commit": _commit()}


def _commit() -> str:
    if os.environ.get("TANDEM_COMMIT"):
        return os.environ["TANDEM_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return ""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
