"""The CPU kernels' compiler check: a compiler that links libstdc++ into a shared library
statically (one GPU image's `g++` does: a wrapper around a relocated GCC) gives the
extension a private C++ runtime beside torch's, and every check with a formatted message
then crashes or comes out garbled. Such a compiler is passed over for the system's g++,
or the build is refused; a working one is used as it is."""

import os
import shutil
from pathlib import Path

import pytest

from engine.cpu_kernels import build

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (os.path.exists("/usr/bin/g++") and shutil.which("readelf")),
                       reason="needs /usr/bin/g++ and readelf"),
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    build.choose_compiler.cache_clear()
    yield tmp_path
    build.choose_compiler.cache_clear()


def static_wrapper(folder: Path) -> Path:
    """A `g++` that links the C++ runtime statically and logs each call, as that image's does."""
    script = folder / "g++"
    script.write_text(f'#!/bin/sh\necho "$@" >> {folder}/calls\nexec /usr/bin/g++ "$@" -static-libstdc++\n')
    script.chmod(0o755)
    return script


def test_a_compiler_that_links_the_runtime_statically_is_found_out_once(cache):
    wrapper = static_wrapper(cache)
    assert "statically" in build.shared_runtime_problem(str(wrapper))
    links = (cache / "calls").read_text().count("-shared")
    assert links == 1
    assert "statically" in build.shared_runtime_problem(str(wrapper))  # the verdict is kept on disk
    assert (cache / "calls").read_text().count("-shared") == links
    assert build.shared_runtime_problem("/usr/bin/g++") is None


def test_the_system_compiler_is_used_instead_with_a_warning(cache, monkeypatch, caplog):
    wrapper = static_wrapper(cache)
    monkeypatch.setenv("CXX", str(wrapper))
    with caplog.at_level("WARNING", logger=build.__name__):
        assert build.choose_compiler() == "/usr/bin/g++"
    assert any("statically" in r.getMessage() and "/usr/bin/g++ instead" in r.getMessage() for r in caplog.records)
    with build._cxx_env("/usr/bin/g++"):
        assert os.environ["CXX"] == "/usr/bin/g++"
    assert os.environ["CXX"] == str(wrapper)
    # the fingerprint names the compiler: a build by the wrapper is never reused
    assert build.compiler_identity(str(wrapper)) != build.compiler_identity("/usr/bin/g++")


def test_no_usable_compiler_refuses_the_build(cache, monkeypatch):
    monkeypatch.setenv("CXX", str(static_wrapper(cache)))
    monkeypatch.setattr(build, "SYSTEM_CXX", ())
    with pytest.raises(build.KernelBuildError, match="statically"):
        build.choose_compiler()


def test_a_good_compiler_is_kept(cache, monkeypatch):
    monkeypatch.setenv("CXX", "/usr/bin/g++")
    assert build.choose_compiler() == "/usr/bin/g++"
