"""A worker's gRPC client with the cluster token on every call; replies that other
layers read are converted to typed values here, once (WorkerStats). No torch."""

from __future__ import annotations

import asyncio

import grpc

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from worker_runtime.config import Role
from worker_runtime.rpc import call_metadata, channel
from worker_runtime.stats import WorkerStats

# What a call to a worker can raise: its failure, or UsageError when the channel was
# closed under it (the worker was removed while the caller held its client).
RPC_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError)


class WorkerClient:
    """One worker's gRPC stub with the cluster token attached to every call."""

    def __init__(self, worker_id: str, role: Role | str, address: str, token: str | None = None) -> None:
        self.worker_id, self.role, self.address = worker_id, Role(role), address
        self.metadata = call_metadata(token)
        self.channel = channel(address)
        self.stub = (pb_grpc.DecodeWorkerStub if self.role is Role.DECODE else pb_grpc.PrefillWorkerStub)(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def health(self, timeout: float = 5.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)

    async def stats(self, timeout: float = 5.0) -> WorkerStats:
        reply = await self.stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata)
        return WorkerStats.from_pb(reply)

    async def check_integrity(self, timeout: float = 30.0) -> pb.HealthReply:
        return await self.stub.CheckIntegrity(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)

    async def drain(self, on: bool = True, timeout: float = 5.0) -> pb.HealthReply:
        return await self.stub.Drain(pb.DrainRequest(drain=on), timeout=timeout, metadata=self.metadata)

    async def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        try:
            reply = await self.stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata
            )
            return reply.found
        except RPC_ERRORS:
            return False


async def wait_ready(client: WorkerClient, timeout: float = 120.0) -> pb.HealthReply:
    """Poll Health until the worker answers healthy (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = "no answer"
    while asyncio.get_running_loop().time() < deadline:
        try:
            reply = await client.health(timeout=2.0)
            if reply.healthy:
                return reply
            last = reply.error or "unhealthy"
        except grpc.aio.AioRpcError as e:
            last = e.details() or e.code().name
        await asyncio.sleep(0.1)
    raise TimeoutError(
        f"{client.role.value} worker {client.worker_id} at {client.address} not ready after {timeout}s: {last}"
    )
