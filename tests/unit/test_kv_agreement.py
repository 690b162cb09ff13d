"""The controller refuses a worker whose KV cache dtype differs from the workers beside
it (controller/pools.py kv_disagreement): a prefill worker's blocks are written into a
decode worker's cache as they are, so both must hold the same dtype."""

from __future__ import annotations

import pytest

from controller.pools import kv_disagreement

pytestmark = pytest.mark.unit

FP8 = {"dtype": "bfloat16", "kv_cache_dtype": "float8_e4m3fn"}
BF16 = {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}


def test_agreeing_workers_pass_and_a_different_kv_dtype_is_named():
    assert kv_disagreement("decode-1", FP8, {"prefill-0": FP8, "decode-0": FP8}) is None
    assert kv_disagreement("decode-1", FP8, {}) is None
    assert kv_disagreement("decode-1", FP8, {"prefill-0": {"dtype": "bfloat16"}}) is None  # one that says nothing
    why = kv_disagreement("decode-1", FP8, {"prefill-0": BF16})
    assert why == ("decode-1 keeps its KV cache in float8_e4m3fn and prefill-0 in bfloat16: prefill and decode "
                   "workers must agree on --kv-cache-dtype (and the model's --dtype)")
