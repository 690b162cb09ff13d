"""Just-in-time build of tandem's CPU kernels: every .cpp file shipped in this folder
(paged_attention.cpp: paged decode attention; linear.cpp: the small-batch bf16 linear
layer), built into one extension whose ops are `torch.ops.<name>.*`.

`load()` compiles them with torch.utils.cpp_extension.load (needs ninja and a C++
compiler) the first time on a machine, then loads the cached binary (well under a
second). The extension's name carries a fingerprint of the torch version, the flags
and the CPU's instruction set, so an upgraded torch, or a cache directory shared by
different machines, never loads a stale or illegal binary.

Where: $TANDEM_CACHE_DIR/torch_extensions/<name> when that variable is set, else
torch's own extension cache ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions).

Concurrency: processes that build or load the same kernels take turns on an flock of
`<build dir>/tandem.lock` (the first compiles, the others then load its binary). The
kernel releases an flock when its holder dies, so a build killed halfway (Ctrl-C on a
first start) costs the next start nothing: torch's own `<build dir>/lock` file, which
would make torch's loader wait for ever, is known to be stale once we hold the flock,
and is removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from engine import envs

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # part of the fingerprint, not compiled alone
TURN_WAIT_S = 1800.0  # a first compile takes about a minute on 2 cores
# -ffp-contract=off: no multiply-add fused into one rounding unless the source asks for it
# (fused.cpp rounds where torch does)
BASE_CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded; the message says why."""


def load() -> Any:
    """The kernel's ops, `torch.ops.<name>` (built on first use per machine).

    Raises KernelBuildError when the build or the load fails; a failure is
    remembered, so a process tries (and logs) at most once.
    """
    ops, error = _load_once()
    if error is not None:
        raise error
    return ops


def load_or_none() -> Any:
    """`load()`, or None (one warning per process) where the kernels cannot be built:
    for callers that fall back to torch operators."""
    ops, error = _load_once()
    if error is not None and not getattr(error, "logged", False):
        error.logged = True
        log.warning("cpu kernels unavailable (%s): falling back to torch operators", error)
    return ops


@functools.lru_cache(maxsize=None)
def _load_once() -> tuple[Any, KernelBuildError | None]:
    try:
        return _build_and_load(), None
    except KernelBuildError as e:
        return None, e


def _build_and_load() -> Any:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        raise KernelBuildError("ninja is not installed (`pip install ninja`)")
    cxx = cpp_extension.get_cxx_compiler()
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler: {cxx!r} not found (install g++ or set CXX)")
    cflags = BASE_CFLAGS + march_flags()
    name = extension_name(cflags)
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _turn(build_dir / "tandem.lock"):
        _remove_stale_lock(build_dir / "lock")
        cached = (build_dir / f"{name}.so").exists()
        if not cached:
            log.info("compiling the cpu kernels into %s (once per machine)", build_dir)
        t0 = time.perf_counter()
        try:
            cpp_extension.load(  # registers the ops with torch (TORCH_LIBRARY)
                name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False, is_python_module=False,
            )
            ops = getattr(torch.ops, name)
            ops.simd_lanes()
        except Exception as e:  # compiler errors arrive as RuntimeError with the log
            raise KernelBuildError(f"building the cpu kernels failed: {_reason(e)}") from e
    if not cached:
        log.info("cpu kernels ready in %.1fs", time.perf_counter() - t0)
    return ops


def march_flags() -> list[str]:
    """["-march=native"] when the compiler accepts it, else [] (portable build)."""
    from torch.utils import cpp_extension

    try:
        cxx = cpp_extension.get_cxx_compiler()
        probe = subprocess.run(
            [cxx, "-march=native", "-x", "c++", "-E", "-o", os.devnull, os.devnull],
            capture_output=True, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-march=native"] if probe.returncode == 0 else []


def extension_name(cflags: list[str]) -> str:
    """`tandem_cpu_<hash>` over torch version, flags, CPU flags and the sources (headers too)."""
    h = hashlib.sha256()
    sources = [p.read_bytes() for p in SOURCES + HEADERS]
    for part in (torch.__version__, " ".join(cflags), platform.machine(), _cpu_flags(), *sources):
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return f"tandem_cpu_{h.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Under the tandem cache (engine/envs.py), next to the built-in model."""
    return envs.cache_dir() / "torch_extensions" / name


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo), else the processor name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@contextlib.contextmanager
def _turn(path: Path, wait_s: float = TURN_WAIT_S):
    """Hold an exclusive flock of `path` (waiting at most `wait_s` for another builder)."""
    import fcntl

    with open(path, "a") as f:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildError(f"another process held {path} for {wait_s:.0f} s") from None
                if not said:
                    log.info("cpu kernels: another process is compiling them; waiting for it")
                    said = True
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_lock(lock: Path) -> None:
    """With the turn held, torch's lock file can only be a killed build's."""
    if lock.exists():
        log.warning("cpu kernels: removing %s, left by a build that was stopped halfway", lock)
        lock.unlink(missing_ok=True)


def _reason(e: Exception) -> str:
    """The informative line of a build log: a compiler error, else a missing tool."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for marker in ("error:", "not found", "undefined symbol", "cannot open"):
        hit = next((ln for ln in lines if marker in ln), None)
        if hit:
            return hit[:300]
    return lines[0][:300] if lines else type(e).__name__
