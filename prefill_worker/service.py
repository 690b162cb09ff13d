"""The prefill worker process: PrefillEngine on its loop, the KV transport it writes
with, and the gRPC PrefillWorker service.

Peers: the first request for a decode worker incarnation (worker_id, epoch) triggers a
handshake with it over gRPC (descriptors exchanged through our own channel, never
NIXL's listener). A new epoch for a known worker replaces the old peer and fails
every handoff still tied to the old incarnation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging
import time

import grpc

from engine.build import build_parts
from engine.sampling_params import SamplingParamsError
from engine.scheduler import AdmissionError, Scheduler
from kv_transfer.base import PeerId
from prefill_worker.prefill_engine import PrefillEngine, PrefillFailed, PrefillResult
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from protos.handoff import prefill_reply
from protos.sampling import params_from_pb
from worker_runtime import tracing
from worker_runtime.addresses import resolve as resolve_host
from worker_runtime.config import Role, WorkerConfig
from worker_runtime.grammar import matcher_for
from worker_runtime.kv_events import KVEventHub
from worker_runtime.loop import EngineLoop
from worker_runtime.rpc import call_metadata, channel, epoch_str, new_epoch, start_server
from worker_runtime.service import WorkerRpcs, make_worker_kv, process_age_s, tls_note
from worker_runtime.stats import WorkerStats, engine_fields

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0


class PrefillWorker(WorkerRpcs, pb_grpc.PrefillWorkerServicer):
    role = Role.PREFILL

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.draining = False
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._peers: dict[str, tuple[int, PeerId]] = {}  # decode worker id -> (epoch, peer)
        self._peer_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> str:
        cfg = self.config
        # whole prompts only: no second weight copies for the decode-step kernels, no decode graphs
        engine_cfg = dataclasses.replace(cfg.engine_config(), device=dataclasses.replace(
            cfg.engine.device, small_batch_linear=False, cuda_graphs=False))
        parts = await asyncio.to_thread(build_parts, engine_cfg)
        self.epoch = new_epoch()
        self.endpoint = resolve_host(cfg.host)
        self.kv = await asyncio.to_thread(make_worker_kv, cfg, self.epoch, self.endpoint, parts.runner,
                                          parts.checkpoint.config.num_kv_heads)
        self.transport = self.kv.transport
        self.engine = PrefillEngine(
            parts.runner,
            Scheduler(parts.scheduler_config, parts.pool, hand_off=True),
            self.transport,
            parts.eos_ids,
            layerwise=cfg.layerwise_transfer,
            transfer_timeout_s=cfg.handoff.transfer_s,
            structured=parts.structured,
            kv=self.kv,
        )
        self.max_model_len = parts.scheduler_config.max_model_len
        loop = asyncio.get_running_loop()
        self.kv_events = KVEventHub(parts.pool, cfg.worker_id, self.epoch, loop)
        self.metrics = self.make_metrics()
        self.engine.metrics = self.metrics
        self.add_parallel_metrics(self.engine.runner)
        if cfg.metrics_port is not None:
            self.metrics.serve(self.endpoint.bind, cfg.metrics_port, self.endpoint.advertise)
        self.loop = EngineLoop(self._step, self._wait_s, lambda _: None, self._on_fatal, name="prefill-engine",
                               on_idle=self.engine.runner.mark_idle)
        self.engine_loop = self.loop
        self.loop.start(loop)
        # before any prompt (commands run in order): warm the kernels and give the router
        # a prefill rate, which its spill rule needs before the first burst
        self.loop.post(self.engine.measure_rate, self.max_model_len)
        self.server, port = await start_server(
            lambda s: pb_grpc.add_PrefillWorkerServicer_to_server(self, s), self.endpoint.bind, cfg.port,
            cfg.cluster_token,
        )
        self.address = f"{self.endpoint.advertise}:{port}"
        log.info(
            "prefill worker %s (epoch %s) serving on %s%s, transport %s, layer-wise push %s; up %.1f s after its "
            "process started",
            cfg.worker_id,
            epoch_str(self.epoch),
            self.address,
            tls_note(cfg),
            self.transport.name,
            cfg.layerwise_transfer,
            process_age_s(),
        )
        return self.address

    async def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        self.loop.stop()
        self.transport.close()
        self.engine.runner.close()

    def stats(self) -> WorkerStats:
        """Any thread: a snapshot read without locks."""
        s = self.engine.scheduler
        return WorkerStats(
            worker_id=self.config.worker_id,
            epoch=self.epoch,
            role=self.role,
            **engine_fields(s, s.pool),
            num_handoffs=len(s.handoff),
            draining=self.draining,
            transport=self.transport.name,
            prefill_tokens_per_s=self.engine.rate.value,
        )

    # ---- engine thread ------------------------------------------------------------------
    def _step(self) -> list:
        out = self.engine.step()
        self.kv_events.publish()
        return out

    def _wait_s(self) -> float | None:
        if self.engine.scheduler.has_work():
            return 0.0
        return 0.0002 if self.engine.scheduler.handoff else None  # transfers in flight: poll them

    def _on_fatal(self, msg: str) -> None:
        for job in list(self.engine.jobs.values()):
            if not job.future.done():
                job.future.set_exception(PrefillFailed(msg))

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    # ---- peers ---------------------------------------------------------------------------
    async def _peer_for(self, target: pb.DecodeTarget) -> PeerId:
        known = self._peers.get(target.worker_id)
        if known is not None and known[0] == target.epoch:
            return known[1]
        lock = self._peer_locks.setdefault(target.worker_id, asyncio.Lock())
        async with lock:
            known = self._peers.get(target.worker_id)
            if known is not None and known[0] == target.epoch:
                return known[1]
            reply = await self._handshake(target.address)
            if reply.epoch != target.epoch:
                raise PrefillFailed(
                    f"decode worker {target.worker_id} at {target.address} is now epoch {epoch_str(reply.epoch)}, "
                    f"not {epoch_str(target.epoch)}: it restarted; retry with a fresh reservation"
                )
            peer = await asyncio.to_thread(self.kv.add_peer, reply.descriptor)  # each of our ranks to its ranks
            if known is not None:
                await self.loop.call(self.engine.drop_peer, known[1], f"decode worker {target.worker_id} restarted")
            self._peers[target.worker_id] = (reply.epoch, peer)
            log.info("peer %s added (epoch %s)", target.worker_id, epoch_str(reply.epoch))
            return peer

    async def _handshake(self, address: str) -> pb.HandshakeReply:
        req = pb.HandshakeRequest(
            worker_id=self.config.worker_id,
            epoch=self.epoch,
            backend=self.transport.name,
            descriptor=self.kv.local_descriptor(),
        )
        async with channel(address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            return await stub.Handshake(
                req, timeout=HANDSHAKE_TIMEOUT_S, metadata=call_metadata(self.config.cluster_token)
            )

    # ---- gRPC ----------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        rid, prompt = request.request_id, list(request.prompt_ids)
        received, parent = time.monotonic(), tracing.parent_from(context.invocation_metadata() or (), required=True)
        try:
            params = params_from_pb(request.params)
            grammar = await matcher_for(self.engine.structured, params)
            if not prompt or len(prompt) >= self.max_model_len:
                raise AdmissionError(
                    f"prompt has {len(prompt)} tokens; this worker allows 1 to {self.max_model_len - 1}"
                )
        except (SamplingParamsError, AdmissionError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            peer = await self._peer_for(request.target)
        except (grpc.aio.AioRpcError, PrefillFailed, OSError, ValueError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"cannot reach decode worker {request.target.worker_id}: {detail}"
            )
        if request.HasField("pull"):  # another worker holds more of the prefix: pulled, not computed
            await self.pull_prefix(rid, prompt, request.pull)
        t = request.target
        done = False
        try:  # any exit without a result (cancelled, timed out, failed) aborts the prefill
            fut: cf.Future = await self.loop.call(
                self.engine.submit,
                rid,
                prompt,
                params,
                int(request.priority),
                peer,
                list(t.block_ids),
                t.num_cached_tokens,
                grammar,
            )
            result: PrefillResult = await asyncio.wait_for(asyncio.wrap_future(fut), self._deadline_s(context))
            done = True
        except (ValueError, AdmissionError) as e:
            done = True  # rejected before anything was queued
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (PrefillFailed, asyncio.TimeoutError) as e:
            log.warning("prefill of %s failed: %s", rid, e or "timed out")
            await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} failed: {e or 'timed out'}")
        finally:
            if not done and self.loop.healthy:
                log.info("prefill of %s ended before its result (cancelled by the router, timed out or "
                         "failed): aborted", rid)
                # idempotent; `peer`: if the submit never ran, the decode worker hears that nothing comes
                self.loop.post(self.engine.abort, rid, "cancelled, timed out or failed", peer)
        if parent is not None:
            self._trace(parent, received, result)
        return self._reply(result)

    @staticmethod
    def _trace(parent, received: float, r: PrefillResult) -> None:
        """This call's spans: the prefill (queued, computed, KV written) and, in it, the KV
        write's tail (the last write issued to written and notified)."""
        now = time.monotonic()
        span = tracing.start("prefill", parent, received, tracing.SERVER, {
            "tandem.queue_s": r.queue_s, "tandem.prefill_s": r.prefill_s, "tandem.cached_tokens": r.num_cached_tokens})
        tracing.phase("kv_transfer", span, max(received, now - r.transfer_s), now,
                      {"tandem.kv_bytes": r.num_bytes, "tandem.kv_blocks": r.num_blocks})
        tracing.end(span, now)

    def _deadline_s(self, context) -> float:
        """How long this prefill may take: the caller's RPC deadline (the router sends
        the reservation's lease), else the reservation lease this cluster grants. A
        prefill that outlives it would write into an expired reservation."""
        remaining = context.time_remaining()
        return remaining if remaining is not None else self.config.handoff.reservation_lease_s

    @staticmethod
    def _reply(r: PrefillResult) -> pb.PrefillReply:
        return prefill_reply(first_token=r.first_token, logprobs=r.logprobs, num_cached_tokens=r.num_cached_tokens,
                             num_blocks=r.num_blocks, num_bytes=r.num_bytes, queue_s=r.queue_s, prefill_s=r.prefill_s,
                             transfer_s=r.transfer_s)

    async def Abort(self, request, context):
        found = await self.loop.call(self.engine.abort, request.request_id, "aborted by the router")
        return pb.AbortReply(found=bool(found))
