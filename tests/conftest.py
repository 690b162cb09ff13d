"""Suite-wide setup: hermetic caches, Triton's interpreter on CPU-only machines, oneDNN
kept off AMX for the bf16 oracle, each test's speed marker checked against its folder,
and the GPU marker's skip."""

import os
import tempfile

# Triton reads TRITON_INTERPRET once, when it is first imported: set it before anything
# can import triton, and only where there is no CUDA device to run kernels on.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

# The bf16 oracle (greedy tokens equal to transformers' in bf16) needs matmuls whose
# summation order does not depend on how many rows a call has: transformers decodes one
# prompt at a time, the engine batches. oneDNN's AVX512-BF16 kernels keep one order; its
# AMX kernels (Intel Xeons from Sapphire Rapids on) do not, and on such a machine
# transformers' own tokens and the engine's part at the 19th token of one prompt of
# tests/model/test_exactness.py's bf16 test, with every tandem kernel on either path.
# oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first primitive: cap it before any test
# runs (workers the tests start inherit it). tandem's own AMX attention kernel has its
# own switch and stays on; serving and benchmarks are not capped.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

# Built-in model and extensions go to a per-run cache unless the caller chose one.
os.environ.setdefault("TANDEM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "tandem-test-cache"))

import pytest  # noqa: E402

SPEEDS = ("unit", "model", "cluster", "gpu")  # a test's folder is its speed, and its marker

# The suite runs on two xdist workers (pyproject.toml's addopts: `-n 2 --dist loadgroup`):
# a cluster test spends much of its time waiting on other processes (Ray's start, a
# worker's health, a drain), and the other worker's tests fill that time. A test file
# is one unit of work (its module and class fixtures are made once), except the files
# below, whose tests are independent servers and go one by one. Tests that touch what is
# global to the machine (network namespaces, fixed addresses, `ray start`'s record in
# /tmp/ray/ray_current_cluster) share one unit, so they never overlap one another.
ONE_BY_ONE = {"tests/cluster/test_serve.py", "tests/cluster/test_disagg.py"}
MACHINE_WIDE = ("tests/cluster/test_multihost.py",
                "tests/cluster/test_serve.py::test_a_local_serve_from_a_vllm_command_line_ignores_the_ray_cluster")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks into the units' names
def pytest_collection_modifyitems(config, items):
    _check_speed_markers(config, items)
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        path = item.path.relative_to(config.rootpath).as_posix()
        if item.nodeid.startswith(MACHINE_WIDE):
            item.add_marker(pytest.mark.xdist_group("machine-wide"))
        elif path not in ONE_BY_ONE:
            item.add_marker(pytest.mark.xdist_group(path))


def _check_speed_markers(config, items):
    import torch

    wrong = sorted({f"{item.path.relative_to(config.rootpath)} (folder {folder}, marked {marks or 'nothing'})"
                    for item in items
                    for folder in [item.path.parent.name]
                    for marks in [[m for m in SPEEDS if item.get_closest_marker(m)]]
                    if folder in SPEEDS and marks != [folder]})
    if wrong:
        raise pytest.UsageError("each test carries its folder's speed marker, and only that one:\n  "
                                + "\n  ".join(wrong))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
