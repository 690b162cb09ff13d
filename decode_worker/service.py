"""The decode worker process: the decode engine on its loop, the KV transport it
receives into, the handoff ledger, and the gRPC DecodeWorker service.

Remote prefill, as the decode worker sees it (ledger states in capitals):

    Decode(REMOTE) -> reserve blocks: RESERVED, stream the Reservation
    KVLanded notification (data already in the blocks): READY
    -> admitted with its first token: RUNNING -> tokens streamed -> DONE
    lease runs out, stream cancelled or aborted before the KV landed: QUARANTINED
      (the request ends; the blocks stay held until the writer's notification or the
      quarantine's end, then FAILED / EXPIRED frees them)
    writer gave up (a failed notification): FAILED (blocks freed at once)

The ledger is the one owner of every handoff's state and deadlines; the scheduler's
reserved and quarantined blocks follow its callbacks (`_on_quarantine`, `_on_free`).
Everything touching the engine or the ledger runs on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from decode_worker.async_engine import AsyncEngine
from decode_worker.feed import ATTACH_S, FeedSocket, TokenFeed
from decode_worker.llm_engine import LLMEngine
from engine.events import TokenEvent
from engine.sampling_params import SamplingParamsError
from engine.scheduler import AdmissionError, NoCapacity
from engine.sequence import FinishReason
from kv_transfer.ledger import Entry, HandoffState, Ledger
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from protos.handoff import reservation_event
from protos.sampling import params_from_pb
from protos.tokens import can_join, logprobs_from_pb, token_events_to_pb
from worker_runtime import envs, tracing
from worker_runtime.addresses import resolve as resolve_host
from worker_runtime.config import Role, WorkerConfig
from worker_runtime.grammar import matcher_for
from worker_runtime.kv_events import KVEventHub
from worker_runtime.rpc import epoch_str, new_epoch, start_server
from worker_runtime.service import WorkerRpcs, make_worker_kv, process_age_s, tls_note
from worker_runtime.stats import WorkerStats, engine_fields

# handoff states in which a reservation waits for KV (the engine loop polls fast)
AWAITING = (HandoffState.RESERVED, HandoffState.WRITING, HandoffState.READY)

log = logging.getLogger(__name__)


class DecodeWorker(WorkerRpcs, pb_grpc.DecodeWorkerServicer):
    role = Role.DECODE

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.draining = False
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.feeds: dict[str, TokenFeed] = {}  # the routers' token feeds, by id
        self.feed_socket: FeedSocket | None = None
        faults = envs.faults()  # injected (TANDEM_FAULTS)
        self.refusals_left = int(faults.refuse_decodes)
        self.reserve_delay_s = faults.reserve_delay_s

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> str:
        """Build the engine and transport, start the engine thread and gRPC server;
        returns host:port."""
        cfg = self.config
        self.engine = await asyncio.to_thread(LLMEngine.from_config, cfg.engine_config())
        self.epoch = new_epoch()
        self.endpoint = resolve_host(cfg.host)
        self.kv = await asyncio.to_thread(make_worker_kv, cfg, self.epoch, self.endpoint, self.engine.runner,
                                          self.engine.checkpoint.config.num_kv_heads)
        self.transport = self.kv.transport
        timeouts = cfg.handoff
        self.ledger = Ledger(self._on_free, default_lease_s=timeouts.reservation_lease_s, exclusive_blocks=False,
                             quarantine_s=timeouts.quarantine_s, on_quarantine=self._on_quarantine)
        self.aengine = AsyncEngine(self.engine, poll_input=self._poll_landings, abort=self._abort,
                                   expects_input=lambda: self.ledger.count(*AWAITING) > 0)
        self.aengine.on_step = self._after_step
        self.engine_loop = self.aengine.loop
        loop = asyncio.get_running_loop()
        self.kv_events = KVEventHub(self.engine.pool, cfg.worker_id, self.epoch, loop)
        self.metrics = self.make_metrics()
        self.engine.on_forward = self.metrics.on_step
        if self.engine.spec is not None:
            self.metrics.add_spec(lambda: self.engine.spec.stats)
        self.metrics.add_counter(
            "tandem:worker_steps_planned_ahead",
            "Engine steps planned and launched while the step before ran on the device (asynchronous "
            "scheduling); against tandem:worker_step_seconds_count, the share of steps that overlapped.",
            lambda: self.engine.steps_ahead)
        self.add_parallel_metrics(self.engine.runner)
        if cfg.metrics_port is not None:
            self.metrics.serve(self.endpoint.bind, cfg.metrics_port, self.endpoint.advertise)
        self.aengine.start(loop)
        self.feed_socket = FeedSocket()
        await self.feed_socket.start(self.endpoint.bind)
        self.server, port = await start_server(lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(self, s),
                                               self.endpoint.bind, cfg.port, cfg.cluster_token)
        self.address = f"{self.endpoint.advertise}:{port}"
        log.info("decode worker %s (epoch %s) serving on %s%s, transport %s; up %.1f s after its process started",
                 cfg.worker_id, epoch_str(self.epoch), self.address, tls_note(cfg), self.transport.name,
                 process_age_s())
        return self.address

    async def stop(self, grace: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self.feed_socket is not None:
            await self.feed_socket.stop()
        self.aengine.stop()
        self.transport.close()
        self.engine.runner.close()

    def stats(self) -> WorkerStats:
        """Any thread: a snapshot read without locks (plain ints and list copies)."""
        s = self.engine.scheduler
        awaiting, quarantined = list(s.awaiting_kv.values()), list(s.quarantined.values())
        return WorkerStats(
            worker_id=self.config.worker_id, epoch=self.epoch, role=self.role, **engine_fields(s, self.engine.pool),
            num_awaiting_kv=len(awaiting),
            num_reserved_blocks=sum(s.cache.num_held(q.seq_id) for q in awaiting),
            num_quarantined_blocks=sum(s.cache.num_held(q.seq_id) for q in quarantined),
            draining=self.draining,
            transport=self.transport.name)

    # ---- engine thread -------------------------------------------------------------------
    def _reserve(self, rid, prompt_ids, params, priority, lease_s, grammar=None):
        if self.reserve_delay_s:
            time.sleep(self.reserve_delay_s)
        res = self.engine.reserve(rid, prompt_ids, params, priority, grammar)
        self.ledger.reserve(rid, res.block_ids, lease_s=lease_s)
        return res

    def _poll_landings(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        s = self.engine.scheduler
        if not s.awaiting_kv and not s.quarantined:
            # nothing waits for a write and no lease can run out (RUNNING entries hold
            # none): any notification is for a request that is over (skipped below), so
            # leave them queued rather than ask the transport every step. NIXL's
            # get_new_notifs took 3% of a colocated engine thread at rate inf on tiny,
            # and 0.2 ms of a disaggregated one-stream step on small
            return events
        for note in self.kv.notifications():  # a tensor-parallel handoff's once all its ranks' writes landed
            msg = pb.KVLanded.FromString(note.message)
            entry = self.ledger.get(msg.request_id)
            if entry is None or entry.state.terminal:
                continue
            if entry.state is HandoffState.QUARANTINED:  # the late writer is done: blocks are safe again
                self.ledger.writer_done(msg.request_id)
                continue
            if msg.failed:
                self.ledger.fail(msg.request_id, f"prefill worker gave up: {msg.error}", writer_done=True)
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
                entry = self.ledger.get(ev.seq_id)
                if entry is not None and entry.state is HandoffState.RUNNING:
                    self.ledger.finish(ev.seq_id)
        self.kv_events.publish()

    def _abort(self, rid: str, unoffered: bool = False) -> None:
        """`unoffered`: the stream ended before the reservation was handed to gRPC, so no
        router can have passed it to a prefill worker and nothing can land: its blocks are
        freed at once rather than quarantined."""
        entry = self.ledger.get(rid)
        if entry is not None and not entry.state.terminal:
            # quarantines an unlanded reservation (unless none could write); frees a running one
            self.ledger.fail(rid, "aborted", writer_done=unoffered and entry.state is HandoffState.RESERVED)
        else:
            self.engine.abort(rid)

    def _on_quarantine(self, entry: Entry) -> None:
        """The request is over, but a prefill worker may still be writing into its
        blocks: they stay held (not as a sequence) until the ledger frees the entry."""
        self.engine.quarantine(entry.request_id)

    def _on_free(self, entry: Entry) -> None:
        if not self.engine.release(entry.request_id, FinishReason.ERROR):  # reserved or quarantined blocks
            self.engine.abort(entry.request_id)  # it landed: end the running sequence, if still running

    @staticmethod
    def _error_event(rid: str, msg: str) -> TokenEvent:
        return TokenEvent(seq_id=rid, token_id=None, finished=True, finish_reason=FinishReason.ERROR, error=msg)

    def check_integrity(self) -> None:
        """Engine thread: blocks match live sequences; ledger consistent."""
        self.engine.check_integrity()
        self.ledger.check_integrity()
        live = {e.request_id for e in self.ledger.live() if e.state is not HandoffState.QUARANTINED}
        assert live <= set(self.engine.seqs), f"ledger holds finished requests: {live - set(self.engine.seqs)}"
        held = {e.request_id for e in self.ledger.live() if e.state is HandoffState.QUARANTINED}
        quarantined = set(self.engine.scheduler.quarantined)
        assert held == quarantined, f"quarantine differs: ledger {held}, scheduler {quarantined}"

    # ---- gRPC ------------------------------------------------------------------------------
    async def Decode(self, request: pb.DecodeRequest, context):
        rid = request.request_id
        received, parent = time.monotonic(), tracing.parent_from(context.invocation_metadata() or (), required=True)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if self.refusals_left > 0:
            self.refusals_left -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "injected fault: no room")
        try:
            params = params_from_pb(request.params)
            grammar = await matcher_for(self.engine.structured, params)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.param}: {e}")
        prompt, prio = list(request.prompt_ids), int(request.priority)
        feed = self.feeds.get(request.feed_id) if request.feed_id else None
        sink = feed.bind(rid) if feed is not None and not feed.closed else None
        q = self.aengine.subscribe(rid, sink)
        finished = False
        offered = False  # the reservation went to gRPC: from here a prefill worker may write into it
        try:  # any exit before the request finished (cancelled anywhere, even mid-yield) aborts it
            if request.mode == pb.REMOTE_PREFILL:
                lease = request.lease_s or self.config.handoff.reservation_lease_s
                res = await self.aengine.call(self._reserve, rid, prompt, params, prio, lease, grammar)
                offered = True
                yield reservation_event(block_ids=res.block_ids, num_cached_tokens=res.num_cached_tokens,
                                        lease_s=lease, worker_id=self.config.worker_id, epoch=self.epoch)
            else:
                await self.aengine.call(self.engine.add_request, rid, prompt, params, prio, None,
                                        list(request.output_ids), grammar)
            if sink is not None:  # the tokens go on the feed; this stream ends with the request
                if not await sink.done:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"token feed {feed.feed_id} closed")
                finished = True
            held = None  # an event that could not join the previous message
            while not finished:
                evs = [held if held is not None else await q.get()]
                held = None
                while not evs[-1].finished and not q.empty():  # what queued while the last message was sent
                    ev = q.get_nowait()
                    if not can_join(evs[-1], ev):
                        held = ev
                        break
                    evs.append(ev)
                finished = evs[-1].finished
                yield token_events_to_pb(evs)
        except NoCapacity as e:
            finished = True  # nothing was reserved
            log.info("request %s refused: %s", rid, e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (AdmissionError, ValueError) as e:
            finished = True
            log.info("request %s refused: %s", rid, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.aengine.unsubscribe(rid)
            if sink is not None:
                feed.unbind(rid)
                finished = finished or sink.saw_finished  # its last event is out: nothing to abort
            if parent is not None:  # the call on this worker: a reservation (or admission) to the finish
                tracing.end(tracing.start("decode_engine", parent, received, tracing.SERVER, {
                    "tandem.remote_prefill": request.mode == pb.REMOTE_PREFILL}), error=None if finished else "closed")
            if not finished and self.aengine.healthy:
                # the router closed the stream: its client went away, or a stop string or
                # a failure elsewhere ended the request first
                log.info("request %s: stream closed by the router before the request finished; aborted", rid)
                self.aengine.post(self._abort, rid, not offered)  # idempotent; queued after the reserve/add

    async def Feed(self, request: pb.FeedRequest, context):
        """A router's token feed (decode_worker/feed.py): open until the router closes it."""
        if not request.feed_id or request.feed_id in self.feeds:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"feed id {request.feed_id!r} is empty or in use")
        feed = self.feeds[request.feed_id] = TokenFeed(request.feed_id)
        key = None
        try:
            if request.socket and self.feed_socket is not None:
                # batches go on the router's connection (FeedSocket); this stream stays
                # open as long as the feed does, and ends (OK) when it closes
                key = self.feed_socket.offer(feed)
                yield pb.FeedBatch(socket_port=self.feed_socket.port, socket_key=key)
                try:
                    await asyncio.wait_for(feed.attached.wait(), ATTACH_S)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"token feed {request.feed_id}: no connection within {ATTACH_S:.0f} s")
                await feed.ended.wait()
                return
            async for batch in feed.batches():
                yield batch
        finally:
            if key is not None:
                self.feed_socket.withdraw(key)
            feed.close()
            self.feeds.pop(request.feed_id, None)

    async def Abort(self, request, context):
        return pb.AbortReply(found=await self.aengine.call(self._abort_by_rpc, request.request_id))

    def _abort_by_rpc(self, rid: str) -> bool:
        """Engine thread: abort `rid` and end its Decode stream (its subscriber gets a
        finished event; a plain abort emits none, the stream's own exit being the usual
        caller). False for an unknown or already finished request."""
        if rid not in self.engine.seqs:  # unknown, finished, or quarantined (no longer a request)
            return False
        self._abort(rid)
        self.aengine.loop.deliver([TokenEvent(seq_id=rid, token_id=None, finished=True,
                                              finish_reason=FinishReason.ABORT, error="aborted by an Abort request")])
        return True

    async def Handshake(self, request, context):
        if request.backend != self.transport.name:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"transport mismatch: peer uses {request.backend}, this worker {self.transport.name}")
        return pb.HandshakeReply(worker_id=self.config.worker_id, epoch=self.epoch, backend=self.transport.name,
                                 descriptor=self.kv.local_descriptor())
