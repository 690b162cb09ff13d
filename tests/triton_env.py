"""The Triton tests' shared check: the kernels run on CUDA, or on CPU under the Triton
interpreter, which tests/conftest.py turns on before anything imports triton."""

from __future__ import annotations

import pytest
import torch

# kernel vs the fp32 reference, by the dtype of the kernel's inputs
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def kernels_or_skip():
    """(engine.attention.triton.kernels, the device they run on); skips the calling
    module when triton is missing, or was imported without the interpreter on a CPU."""
    pytest.importorskip("triton", reason="triton is not installed; the triton backend is optional")
    from engine.attention.triton import kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not kernels.interpreter_ready():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU; run these tests with "
                    "TRITON_INTERPRET=1", allow_module_level=True)
    return kernels, device
