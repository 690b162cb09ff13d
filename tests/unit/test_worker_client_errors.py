"""A worker removed from the pool has its channel closed; a request that picked it just
before (a fallback to local prefill, a stream being opened) must get a retryable
backend error, never gRPC's UsageError escaping as an unhandled 500."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb
from router.backend import BackendError, GenerateRequest
from router.worker_client import disaggregated_stream, local_stream, run_prefill
from worker_runtime.client import WorkerClient

pytestmark = pytest.mark.unit

REQ = GenerateRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=4))


async def closed(role: str) -> WorkerClient:
    c = WorkerClient(f"{role}-9", role, "127.0.0.1:9", "token")  # nothing listens there: never dialled
    await c.close()  # what the pool does to a removed worker
    return c


async def test_a_stream_on_a_closed_channel_is_a_retryable_error():
    d = await closed("decode")
    with pytest.raises(BackendError) as e:
        async for _ in local_stream(d, REQ):
            pass
    assert e.value.status == 503 and e.value.retry_after and "decode-9" in str(e.value)
    with pytest.raises(BackendError) as e:
        async for _ in disaggregated_stream(await closed("prefill"), d, REQ):
            pass
    assert e.value.status == 503 and "decode-9" in str(e.value)


async def test_a_prefill_on_a_closed_channel_is_a_failed_outcome():
    res = pb.Reservation(worker_id="decode-0", epoch=1, block_ids=[0])
    d = WorkerClient("decode-0", "decode", "127.0.0.1:9", "token")
    out = await run_prefill(await closed("prefill"), d, REQ, res, timeout=1.0)
    await d.close()
    assert out.reply is None and "prefill-9" in out.error and "closed" in out.error
