"""gRPC clients of the workers, and one request's path through them.

Disaggregated (the router's side of protos/tandem.proto):

    D.Decode(REMOTE) ---> Reservation ----------------------+
    P.Prefill(target = reservation) ---> first token -------+--> stream token 0 at once
    D stream: Tokens from output index 1 (index 0 arrives too when D lands; skipped)

If the prefill fails (P died, transfer failed, P overloaded), the decode stream is
cancelled (D frees the reservation) and the request is prefilled locally on D, or,
with `fallback_local=False`, ends with an error. Colocated / short prompts:
D.Decode(LOCAL) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos import tandem_pb2 as pb
from protos.handoff import decode_request, prefill_request
from protos.tokens import TokenBatch, batch_from_pb, logprobs_from_pb
from router import token_feed
from router.backend import BackendError, GenerateRequest
from worker_runtime import tracing
from worker_runtime.client import RPC_ERRORS, WorkerClient

log = logging.getLogger(__name__)

CONNECT_STATUSES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass
class PrefillOutcome:
    reply: pb.PrefillReply | None
    error: str | None = None


def _decode_request(req: GenerateRequest, mode: int, lease_s: float, feed_id: str = "") -> pb.DecodeRequest:
    return decode_request(request_id=req.request_id, prompt_ids=req.prompt_ids, params=req.params,
                          priority=req.priority, mode=mode, lease_s=lease_s, output_ids=req.output_ids,
                          feed_id=feed_id)


def rpc_error(e: grpc.aio.AioRpcError | grpc.aio.UsageError, who: str) -> BackendError:
    """Map a worker's gRPC failure to what the client sees. UsageError: the worker was
    removed from the pool (its channel closed) after this request chose it; retryable,
    on another worker."""
    if isinstance(e, grpc.aio.UsageError):
        return BackendError(f"{who} was removed (its channel is closed)", 503, retry_after=1.0)
    code = e.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BackendError(f"{who} is full: {e.details()}", 503, retry_after=1.0, full=True)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BackendError(e.details(), 400)
    if code in CONNECT_STATUSES:
        return BackendError(f"{who} unavailable: {e.details()}", 503, retry_after=1.0)
    return BackendError(f"{who} failed: {code.name}: {e.details()}", 500)


class _DecodeCall:
    """One request's Decode call and, when this router has a token feed open to the
    worker (router/token_feed.py), the queue its tokens arrive on."""

    def __init__(self, decode: WorkerClient, req: GenerateRequest, mode: int, lease_s: float) -> None:
        self.decode, self.rid = decode, req.request_id
        self.call = self._pump = None
        self.reader = token_feed.reader_for(decode)
        self.queue, feed_id = self.reader.register(self.rid) if self.reader is not None else (None, "")
        try:
            self.call = decode.stub.Decode(_decode_request(req, mode, lease_s, feed_id),
                                           metadata=decode.metadata + tracing.metadata(req.trace))
        except grpc.aio.UsageError as e:
            self.close()
            raise rpc_error(e, f"decode worker {decode.worker_id}") from e

    def close(self) -> None:
        if self.reader is not None:
            self.reader.release(self.rid)
        if self.call is not None:
            self.call.cancel()
        if self._pump is not None:
            self._pump.cancel()

    async def tokens(self) -> AsyncIterator[TokenBatch]:
        """The request's token batches up to its finished one, from the feed and from
        its own stream alike (the first message, a reservation, already read)."""
        if self.queue is None:
            async for batch in _decode_tokens(self.call, self.decode):
                yield batch
            return
        self._pump = asyncio.get_running_loop().create_task(self._pump_stream())
        wait_s = None  # until the Decode stream closes; then its last tokens may still be on the feed
        while True:
            if wait_s is None:
                item = await self.queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self.queue.get(), wait_s)
                except TimeoutError:
                    raise BackendError(f"decode worker {self.decode.worker_id} ended the stream early", 500) from None
            if item is _STREAM_END:
                wait_s = FEED_GRACE_S
            elif item is token_feed.FEED_LOST:
                continue  # the Decode stream's own status tells what became of the request
            elif isinstance(item, BaseException):
                raise rpc_error(item, f"decode worker {self.decode.worker_id}")
            else:
                yield batch_from_pb(item)
                if item.finished:
                    return

    async def _pump_stream(self) -> None:
        try:
            while True:
                ev = await self.call.read()
                if ev is grpc.aio.EOF:
                    self.queue.put_nowait(_STREAM_END)
                    return
                if ev.WhichOneof("kind") == "tokens":
                    self.queue.put_nowait(ev.tokens)
        except RPC_ERRORS as e:
            self.queue.put_nowait(e)


_STREAM_END = object()
FEED_GRACE_S = 10.0  # a Decode stream that ended waits this long for its last tokens on the feed


async def local_stream(decode: WorkerClient, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
    """The decode worker prefills and decodes by itself."""
    dc = _DecodeCall(decode, req, pb.LOCAL_PREFILL, 0.0)
    try:
        async with contextlib.aclosing(dc.tokens()) as tokens:
            async for batch in tokens:
                yield batch
    finally:
        dc.close()


async def run_prefill(prefill: WorkerClient, decode: WorkerClient, req: GenerateRequest, res: pb.Reservation,
                      timeout: float, pull: pb.PullSource | None = None) -> PrefillOutcome:
    preq = prefill_request(request_id=req.request_id, prompt_ids=req.prompt_ids, params=req.params,
                           priority=req.priority, reservation=res, decode_address=decode.address, pull=pull)
    span = tracing.start("remote_prefill", req.trace, kind=tracing.CLIENT, attributes={
        "tandem.prefill_worker": prefill.worker_id, "tandem.decode_worker": decode.worker_id})
    outcome = PrefillOutcome(None, "cancelled")
    try:
        outcome = PrefillOutcome(await prefill.stub.Prefill(
            preq, timeout=timeout, metadata=prefill.metadata + tracing.metadata(tracing.context_of(span))))
    except grpc.aio.AioRpcError as e:
        outcome = PrefillOutcome(None, f"prefill worker {prefill.worker_id}: {e.code().name}: {e.details()}")
    except grpc.aio.UsageError:
        outcome = PrefillOutcome(None, f"prefill worker {prefill.worker_id} was removed (its channel is closed)")
    finally:
        tracing.end(span, error=outcome.error)
    return outcome


async def disaggregated_stream(prefill: WorkerClient, decode: WorkerClient, req: GenerateRequest,
                               lease_s: float = 30.0, fallback_local: bool = True,
                               on_prefill=None, pull: pb.PullSource | None = None) -> AsyncIterator[TokenBatch]:
    """Reserve on D, prefill on P into the reservation, then stream D's tokens.
    `on_prefill(outcome)` (optional) sees the prefill's reply or error (for metrics).
    `pull`: a worker holding more of the prompt's prefix than P, which P pulls from."""
    dc = _DecodeCall(decode, req, pb.REMOTE_PREFILL, lease_s)
    call = dc.call
    try:
        try:
            first = await call.read()
        except RPC_ERRORS as e:
            raise rpc_error(e, f"decode worker {decode.worker_id}") from e
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "reservation":
            raise BackendError(f"decode worker {decode.worker_id} sent no reservation", 500)
        outcome = await run_prefill(prefill, decode, req, first.reservation, timeout=lease_s, pull=pull)
        if on_prefill is not None:
            on_prefill(outcome)
        if outcome.reply is None:
            call.cancel()  # D frees the reservation
            if not fallback_local:
                raise BackendError(f"prefill failed: {outcome.error}", 503, retry_after=1.0)
            log.warning("request %s: %s; prefilling locally on %s", req.request_id, outcome.error, decode.worker_id)
            # a new attempt id: the failed reservation may still be quarantined under the old one
            retry = dataclasses.replace(req, request_id=f"{req.request_id}#local")
            async with contextlib.aclosing(local_stream(decode, retry)) as local:
                async for batch in local:
                    yield batch
            return
        r = outcome.reply
        if r.first_token >= 0:  # < 0: the grammar left no first token; the decode worker ends it
            yield TokenBatch(0, [r.first_token], [logprobs_from_pb(r.logprobs)] if r.HasField("logprobs") else [])
        async with contextlib.aclosing(dc.tokens()) as tokens:
            async for ev in tokens:
                if ev.token_ids and ev.first_index == 0:  # D's copy of the first token
                    ev.token_ids, ev.logprobs, ev.first_index = ev.token_ids[1:], ev.logprobs[1:], 1
                if ev.token_ids or ev.finished:
                    yield ev
    finally:
        dc.close()


async def _decode_tokens(call, decode: WorkerClient) -> AsyncIterator[TokenBatch]:
    """The rest of a Decode stream whose first message was read with `read()` (gRPC
    does not allow switching to iteration on the same call)."""
    while True:
        try:
            ev = await call.read()
        except RPC_ERRORS as e:
            raise rpc_error(e, f"decode worker {decode.worker_id}") from e
        if ev is grpc.aio.EOF:
            raise BackendError(f"decode worker {decode.worker_id} ended the stream early", 500)
        if ev.WhichOneof("kind") == "tokens":
            yield batch_from_pb(ev.tokens)
            if ev.tokens.finished:
                return
