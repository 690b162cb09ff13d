"""tandem's CPU kernels: every .cpp file in this folder (paged_attention.cpp: paged decode
and prefill attention; linear.cpp: the decode steps' bf16 linear layers; fused.cpp,
decode_layers.cpp, argmax.cpp, threads.cpp), built into one extension per instruction
set, whose ops are `torch.ops.<name>.*`.

Builds (VARIANTS, best first): `amx` (AVX-512 with BF16 dot products and AMX tiles),
`avx512_bf16`, `avx512` (F, BW, VL, DQ, CD), `avx2` (AVX2 with FMA and F16C) on x86-64,
and `generic` (whatever the compiler makes of the portable code) everywhere. Each is
compiled with explicit instruction-set flags, never -march=native, so a build made on
one machine runs on any CPU that has its flags: an image is not tied to the CPU it was
built on. A process loads the best build that this CPU runs (its /proc/cpuinfo flags);
TANDEM_CPU_KERNELS names another (the AVX2 path on an AVX-512 machine, for tests and
benchmarks). One log line says which, and why.

When: `tandem kernels build` (engine/cpu_kernels/cli.py) compiles them once, as a step of
the install (the README's, the images', CI's), into `_prebuilt/` beside these sources
(or the cache directory when the package folder is read-only): a first `tandem serve`
then loads a binary (well under a second) instead of compiling. A build missing there is
compiled at first use into the cache directory, with a warning that says how to avoid
that ($TANDEM_CACHE_DIR/torch_extensions, else ~/.cache/tandem/torch_extensions).

A build's name carries a fingerprint of the torch version, its flags and the sources, so
an upgraded torch or an edited source never loads a stale binary.

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
from engine.cpu_kernels.isa import (  # noqa: F401  (the builds and the CPU's flags, re-exported)
    GENERIC,
    INSTALLED,
    PREBUILT_DIR,
    VARIANTS,
    X86_VARIANTS,
    Variant,
    cpu_flag_set,
    cpu_flags,
    cpu_model,
    runnable,
)

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # part of the fingerprint, not compiled alone
TURN_WAIT_S = 1800.0  # a first compile takes about a minute on 2 cores
# -ffp-contract=off: no multiply-add fused into one rounding unless the source asks for it
# (fused.cpp rounds where torch does)
BASE_CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)  # tuples: torch's loader appends to the lists it is given
SYSTEM_CXX = ("/usr/bin/g++", "/usr/bin/c++")  # tried, in this order, when the configured compiler fails the check


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded; the message says why."""


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KernelBuildError(f"no cpu kernel build named {name!r} here: choose from "
                           f"{', '.join(v.name for v in VARIANTS)}")


def chosen() -> tuple[Variant, str]:
    """The build this process loads and why: TANDEM_CPU_KERNELS, else the best this CPU
    runs. KernelBuildError when the named one does not exist or this CPU cannot run it."""
    want = envs.cpu_kernels()
    if want == "auto":
        return runnable()[0], "the best this CPU runs"
    v = variant(want)
    missing = sorted(v.needs - cpu_flag_set())
    if missing:
        raise KernelBuildError(f"TANDEM_CPU_KERNELS={want}: this CPU lacks {', '.join(missing)}")
    return v, "TANDEM_CPU_KERNELS"


def load(name: str | None = None) -> Any:
    """The ops of build `name` (default: `chosen()`), `torch.ops.<extension name>`.

    Raises KernelBuildError when the build or the load fails; a failure is
    remembered, so a process tries (and logs) at most once per build.
    """
    ops, error = _load_once(name)
    if error is not None:
        raise error
    return ops


def load_or_none() -> Any:
    """`load()`, or None (one warning per process) where the kernels cannot be built or
    loaded: for callers that fall back to torch operators."""
    ops, error = _load_once(None)
    if error is not None and not getattr(error, "logged", False):
        error.logged = True
        log.warning("cpu kernels unavailable (%s): falling back to torch operators", error)
    return ops


@functools.lru_cache(maxsize=None)
def _load_once(name: str | None) -> tuple[Any, KernelBuildError | None]:
    try:
        if name is None:
            v, why = chosen()
            ops, where = _load_variant(v)
            others = [o.name for o in runnable() if o is not v]
            log.info("cpu kernels: %s (%s; %s) from %s%s", v.name, v.describe, why, where,
                     f"; this CPU also runs {', '.join(others)}" if others else "")
            return ops, None
        return _load_variant(variant(name))[0], None
    except KernelBuildError as e:
        return None, e


def loaded_build() -> str | None:
    """The name of the build `load_or_none()` gives this process, or None where none
    loads (asked after the engine loaded it: no new work)."""
    if load_or_none() is None:
        return None
    try:
        return chosen()[0].name
    except KernelBuildError:
        return None


def prebuilt_roots() -> list[Path]:
    """Where built kernels are looked for, in order: the package's `_prebuilt/` (filled at
    install), then the cache directory (builds made at first use)."""
    return [PREBUILT_DIR, envs.cache_dir() / "torch_extensions"]


def _load_variant(v: Variant) -> tuple[Any, Path]:
    """(ops, binary) of build `v`: a built binary when there is one, else compiled now."""
    name = extension_name(v)
    for root in prebuilt_roots():
        binary = root / name / f"{name}.so"
        if binary.exists():
            try:
                return _load_binary(binary, name), binary
            except Exception as e:  # e.g. a binary cut short by a build killed while linking
                log.warning("the built cpu kernels at %s did not load (%s)", binary, _reason(e))
    log.warning("cpu kernels: the %s build was not made at install (`tandem kernels build`); compiling it now, "
                "once per machine", v.name)
    binary = compile_variant(v, envs.cache_dir() / "torch_extensions")
    return _load_binary(binary, name), binary


def _load_binary(binary: Path, name: str) -> Any:
    torch.ops.load_library(str(binary))
    ops = getattr(torch.ops, name)
    ops.simd_lanes()
    ops.set_work_stealing(envs.cpu_work_stealing())
    return ops


def compile_variant(v: Variant, root: Path) -> Path:
    """Compile build `v` into `root/<extension name>/` (taking turns with other builders)
    and return its binary; one already there is kept. KernelBuildError on failure."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        raise KernelBuildError("ninja is not installed (`pip install ninja`)")
    cxx = choose_compiler()
    name = extension_name(v)
    build_dir = root / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelBuildError(f"cannot write {build_dir}: {e}") from e
    binary = build_dir / f"{name}.so"
    with _turn(build_dir / "tandem.lock"):
        _remove_stale_lock(build_dir / "lock")
        if binary.exists():  # another process built it while this one waited
            return binary
        log.info("compiling the %s cpu kernels into %s", v.name, build_dir)
        t0 = time.perf_counter()
        try:
            # The binary is loaded by path afterwards (never through cpp_extension.load's
            # ninja check, which names the sources by path: two checkouts of the same code
            # would rebuild each other's kernels, 40-70 s a time on 2 cores).
            with _cxx_env(cxx):
                cpp_extension.load(  # compiles, links and registers the ops with torch (TORCH_LIBRARY)
                    name=name, sources=[str(p) for p in SOURCES], extra_cflags=[*BASE_CFLAGS, *v.cflags],
                    extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False, is_python_module=False,
                )
        except Exception as e:  # compiler errors arrive as RuntimeError with the log
            binary.unlink(missing_ok=True)
            raise KernelBuildError(f"building the {v.name} cpu kernels failed: {_reason(e)}") from e
        log.info("%s cpu kernels built in %.1fs", v.name, time.perf_counter() - t0)
    return binary


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


def extension_name(v: Variant) -> str:
    """`tandem_cpu_<build>_<hash>` over torch version, flags, architecture and the sources
    (headers too). Not the CPU's flags: a build runs on every CPU that has its own."""
    h = hashlib.sha256()
    sources = [p.read_bytes() for p in SOURCES + HEADERS]
    flags = " ".join((*BASE_CFLAGS, *v.cflags, *LDFLAGS))
    for part in (torch.__version__, flags, platform.machine(), *sources):
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return f"tandem_cpu_{v.name}_{h.hexdigest()[:12]}"


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
