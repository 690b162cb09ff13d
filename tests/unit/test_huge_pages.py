"""The `tandem` command turns on torch's transparent-huge-page allocation before torch
loads (engine/envs.py use_huge_pages), and a process started that way gets its large
tensors on huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_runtime import envs

pytestmark = pytest.mark.unit

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_use_huge_pages_sets_torch_switch_unless_turned_off(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("TANDEM_CPU_HUGE_PAGES", raising=False)
    assert envs.use_huge_pages() is True
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    monkeypatch.setenv("TANDEM_CPU_HUGE_PAGES", "0")
    assert envs.use_huge_pages() is False
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ

    monkeypatch.delenv("TANDEM_CPU_HUGE_PAGES")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the operator's own choice stands
    assert envs.use_huge_pages() is False
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


PROBE = """
import sys
from cli import main as cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
import torch
x = torch.empty(64 << 20, dtype=torch.uint8)
x.fill_(1)
huge = 0
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        huge = int(line.split()[1])
print(huge)
"""


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
@pytest.mark.parametrize("setting, expect_huge", [("1", True), ("0", False)])
def test_tandem_command_gives_torch_tensors_huge_pages(setting, expect_huge):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["TANDEM_CPU_HUGE_PAGES"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    huge_kb = int(out.stdout.split()[-1])
    if expect_huge:
        assert huge_kb >= 32 << 10, f"only {huge_kb} kB of a 64 MiB tensor on huge pages"
    elif "[madvise]" in THP.read_text():  # with "always" the kernel gives huge pages unasked
        assert huge_kb < 2 << 10, f"{huge_kb} kB on huge pages with TANDEM_CPU_HUGE_PAGES=0"


REUSE_PROBE = """
import resource
import torch
from engine.memory import reuse_freed_memory
print(reuse_freed_memory())
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(6 << 20)  # 24 MB: above glibc's own mmap threshold, below 32 MB
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del t
"""


def _reuse_probe(**env_over) -> tuple[bool, list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "TANDEM_CPU_MALLOC_REUSE")}
    env.update(env_over)
    out = subprocess.run([sys.executable, "-c", REUSE_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    return lines[0] == "True", [int(x) for x in lines[1:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_engine_reuses_freed_activation_memory_instead_of_faulting_it_in_again():
    """reuse_freed_memory (engine/memory.py): with it, a 24 MB tensor allocated and freed
    over and over stops taking page faults after a few rounds (measured: from the second
    to the fifth); with glibc's defaults every one is mapped anew (about 525 faults with
    huge pages)."""
    applied, faults = _reuse_probe(THP_MEM_ALLOC_ENABLE="1")
    assert applied
    # three of the last four rounds: the kernel may still take a round's pages back now and
    # then (a CI run once saw 0, 0, 0, 524, the allocator holding them all the while)
    assert sorted(faults[-4:])[2] < 100, faults
    applied, faults = _reuse_probe(THP_MEM_ALLOC_ENABLE="1", TANDEM_CPU_MALLOC_REUSE="0")
    assert not applied
    assert min(faults[-4:]) > 400, faults
    applied, _ = _reuse_probe()  # without huge pages it is left alone
    assert not applied
