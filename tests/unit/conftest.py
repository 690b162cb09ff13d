"""Fixtures shared by the unit tests."""

import pytest

from engine.cpu_kernels import build


@pytest.fixture(scope="session")
def cpu_ops():
    """The compiled CPU kernels' ops (engine/cpu_kernels). A test that asks for them
    fails, not skips, where they do not build: on the machines CI runs on they must."""
    try:
        return build.load()
    except build.KernelBuildError as e:
        pytest.fail(f"the cpu kernels must build here: {e}")
