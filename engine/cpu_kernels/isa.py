"""The builds of tandem's CPU kernels, one per instruction set, and this CPU's flags:
what the loader (build.py) and the `tandem kernels` command (cli.py) choose by. No torch
here, so the command line can list the builds without loading it."""

from __future__ import annotations

import dataclasses
import functools
import platform
from pathlib import Path

PREBUILT_DIR = Path(__file__).parent / "_prebuilt"  # where `tandem kernels build` puts them


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build of the kernels: the compiler flags that select its code paths and the
    CPU flags (as /proc/cpuinfo names them) a CPU needs to run it."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]
    describe: str

    def runs_on(self, cpu_flags: frozenset[str]) -> bool:
        return self.needs <= cpu_flags


# x86-64-v3 (Haswell, Zen 1 and later) and x86-64-v4 (Skylake-SP, Zen 4), spelt out
# flag by flag so that any GCC or Clang of the last years takes them
_V3 = ("-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mmovbe")
_V3_NEEDS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_V4 = _V3 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")
_V4_NEEDS = _V3_NEEDS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_BF16 = ("-mavx512bf16", "-mavx512vnni")
_BF16_NEEDS = frozenset({"avx512_bf16", "avx512_vnni"})

X86_VARIANTS = (
    Variant("amx", _V4 + _BF16 + ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            _V4_NEEDS | _BF16_NEEDS | {"amx_tile", "amx_bf16", "amx_int8"}, "AVX-512 with BF16 and AMX tiles"),
    Variant("avx512_bf16", _V4 + _BF16, _V4_NEEDS | _BF16_NEEDS, "AVX-512 with BF16 dot products"),
    Variant("avx512", _V4, _V4_NEEDS, "AVX-512 F/BW/VL/DQ/CD"),
    Variant("avx2", _V3, _V3_NEEDS, "AVX2 with FMA and F16C"),
)
GENERIC = Variant("generic", (), frozenset(), "portable C++, vectorised by the compiler for the base ISA")
VARIANTS = (*X86_VARIANTS, GENERIC) if platform.machine() in ("x86_64", "AMD64") else (GENERIC,)
INSTALLED = tuple(v for v in VARIANTS if v is not GENERIC) or (GENERIC,)  # what `tandem kernels build` makes


def runnable(cpu_flags: frozenset[str] | None = None) -> list[Variant]:
    """The builds this CPU runs, best first (generic always last)."""
    flags = cpu_flags if cpu_flags is not None else cpu_flag_set()
    return [v for v in VARIANTS if v.runs_on(flags)]


@functools.lru_cache(maxsize=None)
def cpu_flag_set() -> frozenset[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    return frozenset(cpu_flags().split())


def cpu_model() -> str:
    """This CPU's model name (Linux /proc/cpuinfo), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo), else the processor name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def isa_flags() -> list[str]:
    """The flags the builds choose by (vector and matrix extensions), sorted: what a
    results file records of its CPU."""
    return sorted(f for f in cpu_flag_set() if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve")))
