"""The `tandem` command turns on torch's transparent-huge-page allocation before torch
loads (engine/envs.py use_huge_pages), and a process started that way gets its large
tensors on huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import envs

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
from router import cli
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
