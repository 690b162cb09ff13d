"""The decode worker process: the decode engine on its loop, the KV transport it
receives into, the handoff ledger, and the gRPC DecodeWorker service.

Remote prefill, as the decode worker sees it (ledger states in capitals):

    Decode(REMOTE) -> reserve blocks: RESERVED, stream the Reservation
    KVLanded notification (data already in the blocks): READY
    -> admitted with its first token: RUNNING -> tokens streamed -> DONE
    lease runs out first: EXPIRED (blocks freed, the stream ends with an error)
    stream cancelled / aborted / writer gave up: FAILED (blocks freed)

Everything touching the engine or the ledger runs on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from decode_worker.async_engine import AsyncEngine
from decode_worker.engine import LLMEngine, TokenEvent
from engine.config import WorkerConfig
from engine.kv_events import KVEventHub
from engine.worker_metrics import ENGINE_COUNTERS, WorkerMetrics, engine_state
from engine.worker_common import WorkerRpcs, make_transport
from engine.rpc import new_epoch, start_server
from engine.scheduler import AdmissionError, NoCapacity
from engine.sampling_params import SamplingParamsError
from engine.sequence import FinishReason
from kv_transfer.ledger import Entry, HandoffState, Ledger
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from protos.convert import logprobs_from_pb, logprobs_to_pb, params_from_pb

log = logging.getLogger(__name__)


def tokens_message(ev: TokenEvent) -> pb.DecodeEvent:
    t = pb.Tokens(finished=ev.finished, finish_reason=ev.finish_reason.value if ev.finish_reason else "",
                  error=ev.error or "")
    if ev.token_id is not None:
        t.first_index = ev.num_output_tokens - 1
        t.token_ids.append(ev.token_id)
        if ev.logprobs is not None:
            t.logprobs.append(logprobs_to_pb(ev.logprobs))
    if ev.finished:
        t.usage.CopyFrom(pb.Usage(prompt_tokens=ev.num_prompt_tokens, completion_tokens=ev.num_output_tokens,
                                  cached_tokens=ev.num_cached_tokens))
    return pb.DecodeEvent(tokens=t)


class DecodeWorker(WorkerRpcs, pb_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.draining = False
        self.server: grpc.aio.Server | None = None
        self.address = ""

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> str:
        """Build the engine and transport, start the engine thread and gRPC server;
        returns host:port."""
        cfg = self.config
        self.engine = await asyncio.to_thread(LLMEngine.from_config, cfg.engine)
        self.epoch = new_epoch()
        self.transport = make_transport(cfg, self.epoch)
        self.transport.register(self.engine.runner.kv_cache.kv)
        self.ledger = Ledger(self._on_free, default_lease_s=cfg.reservation_lease_s, exclusive_blocks=False)
        self.quarantined: set[str] = set()
        self.aengine = AsyncEngine(self.engine, poll_input=self._poll_landings, abort=self._abort,
                                   expects_input=lambda: len(self.ledger) > 0)
        self.aengine.on_step = self._after_step
        self.engine_loop = self.aengine.loop
        loop = asyncio.get_running_loop()
        self.kv_events = KVEventHub(self.engine.pool, cfg.worker_id, self.epoch, loop)
        self.metrics = WorkerMetrics(cfg.worker_id, self.role, self._metric_state, ENGINE_COUNTERS)
        self.engine.on_forward = self.metrics.on_step
        if cfg.metrics_port is not None:
            self.metrics.serve(cfg.host, cfg.metrics_port)
        self.aengine.start(loop)
        self.server, port = await start_server(lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(self, s),
                                               cfg.host, cfg.port, cfg.cluster_token)
        self.address = f"{cfg.host}:{port}"
        log.info("decode worker %s (epoch %x) serving on %s, transport %s", cfg.worker_id, self.epoch,
                 self.address, self.transport.name)
        return self.address

    async def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        self.aengine.stop()
        self.transport.close()

    def _metric_state(self) -> dict[str, float]:
        s = self.engine.scheduler
        waiting = [q for rid, q in list(s.awaiting_kv.items()) if rid not in self.quarantined]
        return engine_state(s, self.engine.pool) | {
            "tandem:requests_waiting_for_kv": len(waiting),
            "tandem:blocks_reserved_for_incoming_kv": sum(len(q.block_ids) for q in waiting),
            "tandem:blocks_quarantined": sum(len(q.block_ids) for rid, q in list(s.awaiting_kv.items())
                                             if rid in self.quarantined),
        }

    # ---- engine thread -------------------------------------------------------------------
    def _reserve(self, rid, prompt_ids, params, priority, lease_s):
        res = self.engine.reserve(rid, prompt_ids, params, priority, lease_s + 5.0)  # ledger lease fires first
        self.ledger.reserve(rid, res.block_ids, lease_s=lease_s)
        return res

    def _poll_landings(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for note in self.transport.notifications():
            msg = pb.KVLanded.FromString(note.message)
            entry = self.ledger.get(msg.request_id)
            if entry is None or entry.state.terminal:
                if msg.request_id in self.quarantined:  # the late writer is done: blocks are safe again
                    self.quarantined.discard(msg.request_id)
                    self.engine.release(msg.request_id)
                continue
            if msg.failed:
                self.ledger.fail(msg.request_id, f"prefill worker gave up: {msg.error}")
                events.append(self._error_event(msg.request_id, f"prefill failed: {msg.error}"))
                continue
            self.ledger.mark_ready(msg.request_id)
            lp = logprobs_from_pb(msg.logprobs) if msg.HasField("logprobs") else None
            ev = self.engine.mark_landed(msg.request_id, msg.first_token, lp)
            self.metrics.kv_landed.inc()
            self.ledger.start_running(msg.request_id)
            events.append(ev)
        for entry in self.ledger.sweep():
            self.metrics.kv_expired.inc()
            events.append(self._error_event(entry.request_id, f"KV for this request never arrived: {entry.reason}"))
        return events

    def _after_step(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.finished:
                self.quarantined.discard(ev.seq_id)
                entry = self.ledger.get(ev.seq_id)
                if entry is not None and entry.state is HandoffState.RUNNING:
                    self.ledger.finish(ev.seq_id)
        self.kv_events.publish()

    def _abort(self, rid: str) -> None:
        if rid in self.quarantined:
            return  # already ended; its blocks wait out the quarantine
        entry = self.ledger.get(rid)
        if entry is not None and not entry.state.terminal:
            self.ledger.fail(rid, "aborted")  # frees through _on_free
        else:
            self.engine.abort(rid)

    def _on_free(self, entry: Entry) -> None:
        seq = self.engine.scheduler.awaiting_kv.get(entry.request_id)
        if seq is None:  # landed (or never reserved here): nothing can write into it any more
            self.engine.abort(entry.request_id)
            return
        # A prefill worker may still be writing into these blocks: keep them out of use
        # until its notification arrives or the quarantine ends (scheduler lease expiry).
        seq.lease_deadline = self.engine.scheduler.clock() + self.config.reservation_quarantine_s
        self.quarantined.add(entry.request_id)

    @staticmethod
    def _error_event(rid: str, msg: str) -> TokenEvent:
        return TokenEvent(rid, None, finished=True, finish_reason=FinishReason.ERROR, error=msg)

    def check_integrity(self) -> None:
        """Engine thread: blocks match live sequences; ledger consistent."""
        self.engine.check_integrity()
        self.ledger.check_integrity()
        live = {e.request_id for e in self.ledger.live()}
        assert live <= set(self.engine.seqs), f"ledger holds finished requests: {live - set(self.engine.seqs)}"

    # ---- gRPC ------------------------------------------------------------------------------
    async def Decode(self, request: pb.DecodeRequest, context):
        rid = request.request_id
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        try:
            params = params_from_pb(request.params)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.param}: {e}")
        prompt, prio = list(request.prompt_ids), int(request.priority)
        q = self.aengine.subscribe(rid)
        finished = False
        try:  # any exit before the request finished (cancelled anywhere, even mid-yield) aborts it
            if request.mode == pb.REMOTE_PREFILL:
                lease = request.lease_s or self.config.reservation_lease_s
                res = await self.aengine.call(self._reserve, rid, prompt, params, prio, lease)
                yield pb.DecodeEvent(reservation=pb.Reservation(
                    block_ids=res.block_ids, num_cached_tokens=res.num_cached_tokens, lease_s=lease,
                    worker_id=self.config.worker_id, epoch=self.epoch))
            else:
                await self.aengine.call(self.engine.add_request, rid, prompt, params, prio, None,
                                        list(request.output_ids))
            while not finished:
                ev = await q.get()
                finished = ev.finished
                yield tokens_message(ev)
        except NoCapacity as e:
            finished = True  # nothing was reserved
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (AdmissionError, ValueError) as e:
            finished = True
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.aengine.unsubscribe(rid)
            if not finished and self.aengine.healthy:
                self.aengine.post(self._abort, rid)  # idempotent; queued after the reserve/add

    async def Abort(self, request, context):
        return pb.AbortReply(found=await self.aengine.call(self._abort_by_rpc, request.request_id))

    def _abort_by_rpc(self, rid: str) -> bool:
        """Engine thread: abort `rid` and end its Decode stream (its subscriber gets a
        finished event; a plain abort emits none, the stream's own exit being the usual
        caller). False for an unknown or already finished request."""
        if rid not in self.engine.seqs or rid in self.quarantined:
            return False
        self._abort(rid)
        self.aengine.loop.deliver([TokenEvent(rid, None, finished=True, finish_reason=FinishReason.ABORT,
                                              error="aborted by an Abort request")])
        return True

    async def Handshake(self, request, context):
        if request.backend != self.transport.name:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"transport mismatch: peer uses {request.backend}, this worker {self.transport.name}")
        return pb.HandshakeReply(worker_id=self.config.worker_id, epoch=self.epoch, backend=self.transport.name,
                                 descriptor=self.transport.local_descriptor())


    async def Stats(self, request, context):
        s, pool = self.engine.scheduler, self.engine.pool
        return pb.WorkerStats(
            worker_id=self.config.worker_id, epoch=self.epoch, role=self.role, num_running=len(s.running),
            num_waiting=s.num_waiting, num_awaiting_kv=len(s.awaiting_kv), num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_reserved_blocks=sum(len(q.block_ids) for q in list(s.awaiting_kv.values())),
            queued_prefill_tokens=sum(q.num_tokens for lane in s.lanes.values() for q in list(lane)),
            max_num_seqs=s.config.max_num_seqs, block_size=pool.block_size, prefix_cache_queries=pool.queries,
            prefix_cache_hits=pool.hits, num_preemptions=s.num_preemptions, draining=self.draining,
            transport=self.transport.name, max_model_len=s.config.max_model_len)
