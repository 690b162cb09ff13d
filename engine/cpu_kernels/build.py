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

Compiler: the one torch's loader would use ($CXX, else `c++`), checked once per machine
for how it links the C++ runtime. An extension that carries a private, static copy of
libstdc++ next to the one torch uses loads fine but breaks at the first `std::ostringstream`
(every check with a formatted message: a segmentation fault on one GPU image, whose `g++`
is a wrapper around a relocated GCC; garbled messages elsewhere). Such a compiler is passed
over for the system's /usr/bin/g++ when that one links the runtime as a shared library; if
none does, the build is refused (callers fall back to torch operators).

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
LDFLAGS = ["-fopenmp"]
SYSTEM_CXX = ("/usr/bin/g++", "/usr/bin/c++")  # tried, in this order, when the configured compiler fails the check


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
    cxx = choose_compiler()
    cflags = BASE_CFLAGS + march_flags(cxx)
    name = extension_name(cflags + LDFLAGS + [compiler_identity(cxx)])
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _turn(build_dir / "tandem.lock"):
        _remove_stale_lock(build_dir / "lock")
        binary = build_dir / f"{name}.so"
        cached = binary.exists()
        if cached:
            # The name already fingerprints the sources, flags, torch and CPU, so a built
            # binary is loaded as it is. Through cpp_extension.load, ninja would rebuild it
            # whenever its build file changed, and that file names the sources by path: two
            # checkouts of the same code (a CI clone next to a working tree) would rebuild
            # each other's kernels, 70 s a time on 2 cores.
            try:
                torch.ops.load_library(str(binary))
                ops = getattr(torch.ops, name)
                ops.simd_lanes()
                return ops
            except Exception as e:  # e.g. a binary cut short by a build killed while linking
                log.warning("the cached cpu kernels at %s did not load (%s): building them again", binary,
                            _reason(e))
                cached = False
        if not cached:
            log.info("compiling the cpu kernels into %s (once per machine)", build_dir)
        t0 = time.perf_counter()
        try:
            with _cxx_env(cxx):
                cpp_extension.load(  # registers the ops with torch (TORCH_LIBRARY)
                    name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags, extra_ldflags=LDFLAGS,
                    build_directory=str(build_dir), verbose=False, is_python_module=False,
                )
            ops = getattr(torch.ops, name)
            ops.simd_lanes()
        except Exception as e:  # compiler errors arrive as RuntimeError with the log
            raise KernelBuildError(f"building the cpu kernels failed: {_reason(e)}") from e
    if not cached:
        log.info("cpu kernels ready in %.1fs", time.perf_counter() - t0)
    return ops


def configured_compiler() -> str:
    """The compiler torch's loader uses unless told otherwise: $CXX, else `c++`."""
    from torch.utils import cpp_extension

    return cpp_extension.get_cxx_compiler()


@functools.lru_cache(maxsize=None)
def choose_compiler() -> str:
    """The configured compiler if it links libstdc++ as a shared library, else the first of
    SYSTEM_CXX that does (a warning says so). KernelBuildError when none is usable."""
    configured = configured_compiler()
    if shutil.which(configured) is None:
        raise KernelBuildError(f"no C++ compiler: {configured!r} not found (install g++ or set CXX)")
    reasons = []
    for cxx in [configured, *SYSTEM_CXX]:
        path = shutil.which(cxx)
        if path is None or (cxx != configured and os.path.realpath(path) == os.path.realpath(shutil.which(configured))):
            continue
        reason = shared_runtime_problem(cxx)
        if reason is None:
            if cxx != configured:
                log.warning("cpu kernels: %s (%s); building with %s instead", configured, reasons[0], cxx)
            return cxx
        reasons.append(reason)
    raise KernelBuildError(f"no usable C++ compiler: {configured} {reasons[0]} (set CXX to one that links it as a "
                           "shared library)")


_RUNTIME_PROBE = """#include <sstream>
#include <string>
std::string tandem_probe(int x) { std::ostringstream o; o << x; return o.str(); }
"""


def shared_runtime_problem(cxx: str) -> str | None:
    """None when a shared library that `cxx` links needs libstdc++.so (as torch's own
    libraries do), else why not. The verdict is kept in the cache directory per compiler
    identity, so the probe's compile (0.3 s here) is paid once per machine and compiler."""
    verdict_file = envs.cache_dir() / "torch_extensions" / "compilers" / hashlib.sha256(
        compiler_identity(cxx).encode()).hexdigest()[:16]
    try:
        text = verdict_file.read_text()
        return None if text == "ok" else text
    except OSError:
        pass
    reason = _probe_runtime(cxx)
    if reason is not None and reason.startswith("cannot link"):
        return reason  # possibly passing (a timeout, a full disk): asked again next time
    try:
        verdict_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = verdict_file.with_suffix(f".{os.getpid()}")
        tmp.write_text(reason or "ok")
        tmp.replace(verdict_file)
    except OSError:
        pass
    return reason


def _probe_runtime(cxx: str) -> str | None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tandem-cxx-") as d:
        src, lib = Path(d) / "probe.cpp", Path(d) / "probe.so"
        src.write_text(_RUNTIME_PROBE)
        try:
            run = subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(src), *LDFLAGS, "-o", str(lib)],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot link a shared library ({e})"
        if run.returncode != 0:
            return f"cannot link a shared library ({(run.stderr.strip().splitlines() or ['?'])[-1][:200]})"
        needed = elf_needed(lib)
        if needed is None:
            return None  # no readelf here to tell; assume the usual dynamic link
        if not any(n.startswith("libstdc++.so") or n.startswith("libc++.so") for n in needed):
            return "links libstdc++ statically (a private copy beside torch's breaks formatted messages)"
    return None


def elf_needed(lib: Path) -> list[str] | None:
    """The shared libraries an ELF file names as NEEDED (`readelf -d`), None without readelf."""
    if shutil.which("readelf") is None:
        return None
    try:
        out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [ln.split("[", 1)[1].split("]", 1)[0] for ln in out.splitlines() if "(NEEDED)" in ln and "[" in ln]


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    """The compiler's resolved path and the first line of its `--version`: part of the
    extension's fingerprint, so another compiler never reuses a build (asked once a
    process: the compiler check and the fingerprint both need it)."""
    path = shutil.which(cxx) or cxx
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(path)} {(version.splitlines() or [''])[0]}"


@contextlib.contextmanager
def _cxx_env(cxx: str):
    """$CXX set to `cxx` while torch's loader writes its build file (it reads $CXX there)."""
    old = os.environ.get("CXX")
    if cxx == configured_compiler():
        yield
        return
    os.environ["CXX"] = cxx
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = old


def march_flags(cxx: str | None = None) -> list[str]:
    """["-march=native"] when the compiler accepts it, else [] (portable build)."""
    try:
        cxx = cxx or configured_compiler()
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
