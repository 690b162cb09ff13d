"""Fixtures shared by the unit tests."""

import pytest

from engine.cpu_kernels import build

# The builds of the CPU kernels that the kernel tests run, each in turn: every one this
# CPU can execute among those an install makes (on an AVX-512 machine the AVX2 build
# runs too, so its paths are tested there as well).
KERNEL_BUILDS = [v.name for v in build.runnable() if v in build.INSTALLED]


@pytest.fixture(scope="session")
def cpu_ops():
    """The compiled CPU kernels' ops (engine/cpu_kernels), the build a worker loads here.
    A test that asks for them fails, not skips, where they do not build: on the machines
    CI runs on they must."""
    try:
        return build.load()
    except build.KernelBuildError as e:
        pytest.fail(f"the cpu kernels must build here: {e}")


@pytest.fixture(params=KERNEL_BUILDS)
def kernel_build(request):
    """Each build this CPU runs in turn (its name), made the one `build.load()` returns
    (TANDEM_CPU_KERNELS) for the test that asks for it (and no other: a loaded build is
    kept, so switching costs a lookup)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_CPU_KERNELS", request.param)
    build._load_once.cache_clear()
    try:
        build.load()
    except build.KernelBuildError as e:
        pytest.fail(f"the {request.param} build of the cpu kernels must load here: {e}")
    yield request.param
    mp.undo()
    build._load_once.cache_clear()


@pytest.fixture
def build_ops(kernel_build):
    """The ops of the build `kernel_build` names."""
    return build.load()
