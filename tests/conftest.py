"""Suite-wide setup: hermetic caches, Triton's interpreter on CPU-only machines, and
the GPU marker's skip."""

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

# Built-in model and extensions go to a per-run cache unless the caller chose one.
os.environ.setdefault("TANDEM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "tandem-test-cache"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
