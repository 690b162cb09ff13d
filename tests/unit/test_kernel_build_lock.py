"""The CPU kernels' build lock: a build killed halfway costs the next start nothing
(torch's own lock file would make its loader wait for ever), and processes that build
at once take turns on an flock that the kernel releases when its holder dies."""

import subprocess
import sys
import textwrap
import time

import pytest

from engine.cpu_kernels import build

pytestmark = pytest.mark.unit


def test_a_lock_left_by_a_killed_build_is_removed_at_once(tmp_path, caplog):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its process dies
    with caplog.at_level("WARNING", logger=build.__name__):
        t0 = time.monotonic()
        with build._turn(tmp_path / "tandem.lock"):
            build._remove_stale_lock(tmp_path / "lock")
        assert time.monotonic() - t0 < 1.0
    assert not (tmp_path / "lock").exists()
    assert any("stopped halfway" in r.getMessage() for r in caplog.records)


def test_the_turn_waits_for_a_live_holder_and_passes_when_it_dies(tmp_path):
    path = tmp_path / "tandem.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(path)!r}, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(build.KernelBuildError, match="held"):
            with build._turn(path, wait_s=0.5):
                pass
        holder.kill()  # killed mid-build: the kernel drops its flock
        holder.wait(10)
        t0 = time.monotonic()
        with build._turn(path, wait_s=10):
            assert time.monotonic() - t0 < 2.0
    finally:
        holder.kill()


def test_a_built_binary_loads_without_the_build_step(tmp_path):
    """Once built, the kernels load from their binary, not through cpp_extension.load:
    its ninja file names the sources by path, so a second checkout of the same code
    would rebuild them (and make the first one rebuild them again)."""
    if build.load_or_none() is None:
        pytest.skip("the cpu kernels cannot be built here")
    script = textwrap.dedent("""
        from torch.utils import cpp_extension
        def refuse(*a, **k):
            raise AssertionError("cpp_extension.load was called")
        cpp_extension.load = refuse
        from engine.cpu_kernels import build
        print(build.load().simd_lanes())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0
