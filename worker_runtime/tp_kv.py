"""The KV handoff between workers whose ranks hold different KV heads.

A prefill worker of `a` tensor-parallel ranks hands a prompt's KV to a decode worker of
`b` ranks (any `a`, `b` the model's KV heads allow, either one 1). Every rank has a KV
transport of its own, registered on its own cache, and a worker's descriptor (what the
handshake exchanges) lists its ranks' descriptors in rank order (`group_descriptor`; a
worker of one rank sends its plain descriptor, as before).

**Who writes what** (`kv_pairs`): decode rank j needs the KV heads it holds
(engine/parallel/shard.py `kv_heads_for`); for each, the source is a prefill rank that
holds it, the (j mod holders)-th of them when several do (replicated heads), so the
writes spread over the prefill ranks. The heads going from prefill rank i to decode rank
j form one contiguous run on both sides, so each (i, j) pair is one write per layer
(a `HeadSlice`, or whole blocks where both ranks hold the same heads). Prefill rank 0
always writes to decode rank 0 (both hold head 0, and 0 mod anything is 0); that pair's
last write carries the `KVLanded` with the first token and the number of other pairs
(`shards`); every other pair's last write carries a shard note (`shard_message`).

**Who knows what landed.** The decode worker's rank 0 holds the handoff ledger: the
other decode ranks forward the notes their transports receive to it (`RankKV`, a
thread on each of them), and it admits the request once the KVLanded and all its shards
are in (`Landings`). On the prefill side rank 0 holds the ledger: its own writes it
polls; the other ranks write theirs from the same step's plan (`RankWrites`, sent with
the step), layer by layer as their forward passes go, and report each request's writes
done or failed (`ShardDone`); the handoff is done once all are. A write that fails
anywhere fails the handoff (the router retries it); a shard that never lands leaves the
decode side's reservation to its lease, as any lost write does.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from engine.parallel.shard import kv_heads_for
from kv_transfer.base import (
    HeadSlice,
    Notification,
    PeerDescriptor,
    PeerId,
    TransferError,
    TransferHandle,
    Transport,
    TransportConfig,
    XferState,
)
from protos import tandem_pb2 as pb
from protos.handoff import shard_message

log = logging.getLogger(__name__)

GROUP_MAGIC = b"TDKVG1"


def group_descriptor(ranks: list[bytes]) -> bytes:
    """One worker's descriptor: its ranks' own, in rank order (one rank: that one as it is)."""
    if len(ranks) == 1:
        return ranks[0]
    return GROUP_MAGIC + json.dumps([base64.b64encode(d).decode() for d in ranks]).encode()


def rank_descriptors(data: bytes) -> list[bytes]:
    """A worker's descriptor as its ranks' descriptors, in rank order."""
    if data.startswith(GROUP_MAGIC):
        return [base64.b64decode(d) for d in json.loads(data[len(GROUP_MAGIC):])]
    return [data]


@dataclass(frozen=True)
class Pair:
    """Prefill rank `src` writes `heads` of every block to decode rank `dst` (None:
    whole blocks, both ranks holding the same heads)."""

    src: int
    dst: int
    heads: HeadSlice | None


def kv_pairs(num_kv_heads: int, a: int, b: int) -> list[Pair]:
    """The writes of one handoff from `a` prefill ranks to `b` decode ranks (module doc)."""
    runs: dict[tuple[int, int], list[int]] = {}
    for j in range(b):
        mine = kv_heads_for(num_kv_heads, b, j)
        for h in mine:
            holders = [i for i in range(a) if h in kv_heads_for(num_kv_heads, a, i)]
            i = holders[j % len(holders)]
            runs.setdefault((i, j), []).append(h)
    pairs = []
    for (i, j), heads in sorted(runs.items()):
        src_heads, dst_heads = kv_heads_for(num_kv_heads, a, i), kv_heads_for(num_kv_heads, b, j)
        assert heads == list(range(heads[0], heads[-1] + 1)), "a pair's heads are one run"
        whole = len(heads) == len(src_heads) == len(dst_heads)
        pairs.append(Pair(i, j, None if whole else HeadSlice(heads[0] - src_heads.start,
                                                               heads[0] - dst_heads.start, len(heads))))
    return pairs


@dataclass
class PeerGroup:
    """A decode worker as one writing rank sees it: the pairs of the handoff, and the
    peer id of each decode rank this rank writes to."""

    peer: PeerId  # its rank 0's: the id the worker is known by
    size: int
    pairs: list[Pair]
    rank_peers: dict[int, PeerId] = field(default_factory=dict)

    def mine(self, rank: int) -> list[Pair]:
        return [p for p in self.pairs if p.src == rank]

    @property
    def shards(self) -> int:
        """Writes of a handoff other than (0 -> 0)."""
        return len(self.pairs) - 1

    def writers(self) -> set[int]:
        """Prefill ranks other than 0 that write in a handoff."""
        return {p.src for p in self.pairs if p.src != 0}


def connect_group(transport: Transport, descriptor: bytes, num_kv_heads: int, a: int, rank: int) -> PeerGroup:
    """Add the decode ranks that prefill rank `rank` (of `a`) writes to as peers of
    `transport`; the worker's PeerGroup."""
    descs = rank_descriptors(descriptor)
    first = PeerDescriptor.from_bytes(descs[0]).peer_id
    group = PeerGroup(first, len(descs), kv_pairs(num_kv_heads, a, len(descs)))
    for p in group.mine(rank):
        group.rank_peers[p.dst] = transport.add_peer(descs[p.dst])
    return group


# ---- messages from the other ranks to rank 0 -----------------------------------------------------------

@dataclass
class ShardDone:
    """A prefill rank's writes of one handoff have all finished (or one failed: `reason`)."""

    rank: int
    request_id: str
    reason: str | None = None


@dataclass
class Notes:
    """What a decode rank's transport received, forwarded to rank 0."""

    rank: int
    notes: list  # [(peer name, peer epoch, message bytes)]


def layer_writes(local: list[int], remote: list[int], places: list[tuple[int, int]] | None, layer: int,
                 caught_up: bool) -> list[tuple[list[int], list[int], range]]:
    """The writes that move layer `layer`'s KV, and every layer's before it too where
    nothing was written yet (not `caught_up`): (our blocks, the peer's, slots of them).
    `places`: each layer's (KV group, slot) where the layers keep their KV in groups
    (engine/kv_groups.py; `local` and `remote` then hold each group's blocks in turn, as
    many each); None: one group, a layer's slot its index."""
    if places is None:
        return [(local, remote, range(layer, layer + 1) if caught_up else range(0, layer + 1))]
    each = len(local) // (1 + max(g for g, _ in places))
    out = []
    for n in ([layer] if caught_up else range(layer + 1)):
        g, slot = places[n]
        out.append((local[g * each:(g + 1) * each], remote[g * each:(g + 1) * each], range(slot, slot + 1)))
    return out


@dataclass
class RankWrites:
    """The KV writes of one prefill step's finishing prompts, sent to the other ranks
    with the step: each writes its pairs of each, from the step's own forward pass."""

    jobs: list  # [(request id, decode worker's PeerId, local block ids, remote block ids)]
    layerwise: bool
    num_layers: int
    places: list | None = None  # each layer's (KV group, slot) with KV groups (`layer_writes`)

    def hook(self, runner):
        return runner.rank_parts["kv"].hook(self)


# ---- on every rank but 0 -------------------------------------------------------------------------------

class RankKV:
    """A rank's own transport, the decode workers it writes to, and the thread that
    tells rank 0 what landed (decode) or what its writes did (prefill)."""

    POLL_S = (0.0002, 0.002)  # the reporter's wait between looks: while busy, while idle

    def __init__(self, runner, transport: Transport, num_kv_heads: int) -> None:
        self.runner, self.transport, self.num_kv_heads = runner, transport, num_kv_heads
        self.group = runner.tp
        self.peers: dict[PeerId, PeerGroup] = {}
        self.pending: dict[str, list[TransferHandle]] = {}  # request id -> its last writes here
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._report, name="tp-kv-report", daemon=True)
        self.thread.start()

    # Call targets (run on the rank's main thread, between steps)
    @staticmethod
    def setup(runner, kind: str, config: TransportConfig, num_kv_heads: int) -> bytes:
        import torch

        from kv_transfer.registry import create_transport

        transport = create_transport(kind, config)
        # views the transport's threads write through must not be made in inference mode
        # (this runs inside the rank's loop, which holds it): torch refuses their updates
        with torch.inference_mode(False):
            transport.register(runner.kv_cache.kv)
        runner.rank_parts["kv"] = RankKV(runner, transport, num_kv_heads)
        return transport.local_descriptor()

    @staticmethod
    def add_peer(runner, descriptor: bytes) -> None:
        me = runner.rank_parts["kv"]
        group = connect_group(me.transport, descriptor, me.num_kv_heads, runner.tp.size, runner.tp.rank)
        me.peers[group.peer] = group

    def hook(self, writes: RankWrites):
        rank, last = self.group.rank, writes.num_layers - 1
        todo = []
        for rid, peer, local, remote in writes.jobs:
            group = self.peers.get(peer)
            pairs = group.mine(rank) if group is not None else []
            if pairs:
                todo.append((rid, group, pairs, local, remote, {}))
            elif group is None:
                log.warning("rank %d: no peer %s for %s's KV", rank, peer, rid)

        def on_layer_done(layer: int) -> None:
            if layer != last and not writes.layerwise:
                return
            ready = self.runner.compute_marker()  # the layer's kernels may still be queued (CUDA)
            for rid, group, pairs, local, remote, handles in todo:
                final = layer == last
                # layer by layer (a first write catches up on the layers before it); else every layer at the end
                moves = (layer_writes(local, remote, writes.places, layer, bool(handles)) if writes.layerwise
                         else [(local, remote, None)])
                done = []
                try:
                    for p in pairs:
                        for i, (ours, theirs, layers) in enumerate(moves):
                            closing = final and i == len(moves) - 1  # the notification goes with the last
                            h = self.transport.write_blocks(
                                group.rank_peers[p.dst], ours, theirs, layers=layers, heads=p.heads,
                                notify=shard_message(rid) if closing else None,
                                after=handles.get(p.dst, ()) if closing else (), ready=ready)
                            handles.setdefault(p.dst, []).append(h)
                            done.append(h)
                except TransferError as e:
                    self.group.send_up(ShardDone(rank, rid, f"rank {rank}: {e}"))
                if final:
                    with self.lock:
                        self.pending[rid] = done

        return on_layer_done

    def _report(self) -> None:
        quiet = 0
        while not self.stop.wait(self.POLL_S[quiet > 50]):
            busy = False
            try:
                notes = self.transport.notifications()
                if notes:
                    busy = True
                    self.group.send_up(Notes(self.group.rank, [(n.peer.name, n.peer.epoch, n.message)
                                                               for n in notes]))
                with self.lock:
                    items = list(self.pending.items())
                for rid, handles in items:
                    busy = True
                    states = [self.transport.poll(h) for h in handles]
                    if not all(s.finished for s in states):
                        continue
                    bad = [s.reason for s in states if s.state is not XferState.DONE]
                    with self.lock:
                        self.pending.pop(rid, None)
                    for h in handles:
                        self.transport.release(h)
                    self.group.send_up(ShardDone(self.group.rank, rid, f"rank {self.group.rank}: {bad[0]}"
                                                 if bad else None))
            except OSError:  # rank 0 is gone: the main loop ends this rank
                return
            except Exception:  # noqa: BLE001 - keep reporting
                log.exception("rank %d: KV report", self.group.rank)
            quiet = 0 if busy else quiet + 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.transport.close()


# ---- on rank 0 -----------------------------------------------------------------------------------------

class WorkerKV:
    """Rank 0's side: its own transport, the other ranks' (through the TP group), the
    decode workers it writes to as PeerGroups, and, on a decode worker, the assembly of
    a handoff's notes (`notifications`). A worker of one rank is the same with no
    other ranks."""

    def __init__(self, transport: Transport, num_kv_heads: int, group=None) -> None:
        self.transport, self.num_kv_heads, self.group = transport, num_kv_heads, group
        self.size = group.size if group is not None else 1
        self.peers: dict[PeerId, PeerGroup] = {}
        self.descriptors: list[bytes] = []
        self.done: dict[str, dict[int, str | None]] = {}  # request id -> {rank: failure or None}
        self.landings = Landings()

    def start(self, config: TransportConfig) -> None:
        """Give every other rank a transport like ours (named `<worker>.r<rank>`)."""
        ours = self.transport.local_descriptor()
        self.descriptors = [ours]
        if self.group is None or self.size == 1:
            return
        kind = PeerDescriptor.from_bytes(ours).transport
        configs = [dataclasses.replace(config, worker_name=f"{config.worker_name}.r{r}", port=0)
                   for r in range(1, self.size)]
        # one Call each rank runs with its own config: the rank picks its own from the list
        self.descriptors += self.group.call(_setup_rank, kind, configs, self.num_kv_heads, timeout_s=60)

    def local_descriptor(self) -> bytes:
        return group_descriptor(self.descriptors or [self.transport.local_descriptor()])

    def add_peer(self, descriptor: bytes) -> PeerId:
        """A decode worker's descriptor (from the handshake): every rank of ours that
        writes to it connects to the decode ranks it writes to."""
        descs = rank_descriptors(descriptor)
        if self.transport.name == "nixl" and any(p.heads is not None for p in
                                                 kv_pairs(self.num_kv_heads, self.size, len(descs))):
            raise ValueError(
                f"its {len(descs)} rank(s) and our {self.size} hold different KV heads, and the NIXL transport "
                "moves whole block regions only: run both pools with --transport tcp, or give them tensor-parallel "
                "sizes whose ranks hold the same heads")
        group = connect_group(self.transport, descriptor, self.num_kv_heads, self.size, 0)
        if group.writers():
            self.group.call(RankKV.add_peer, descriptor, timeout_s=30)
        self.peers[group.peer] = group
        return group.peer

    def group_of(self, peer: PeerId) -> PeerGroup:
        group = self.peers.get(peer)
        if group is None:  # a peer added to the transport directly: one rank each side
            group = PeerGroup(peer, 1, [Pair(0, 0, None)], {0: peer})
        return group

    def rank_writes(self, jobs: list, layerwise: bool, num_layers: int,
                    places: list | None = None) -> RankWrites | None:
        """What the other ranks write in this step (None when they write nothing)."""
        if self.size == 1:
            return None
        mine = [(rid, peer, local, remote) for rid, peer, local, remote in jobs
                if self.group_of(peer).writers()]
        return RankWrites(mine, layerwise, num_layers, places) if mine else None

    def shards_done(self, request_id: str, peer: PeerId) -> tuple[bool, str | None]:
        """(whether every other rank's writes of this handoff finished, the first failure)."""
        if self.size > 1:
            self.group.read()
            for m in self.group.take(ShardDone):
                self.done.setdefault(m.request_id, {})[m.rank] = m.reason
            while len(self.done) > 4096:  # reports of handoffs that ended before them
                self.done.pop(next(iter(self.done)))
        want = self.group_of(peer).writers()
        if not want:
            return True, None
        got = self.done.get(request_id, {})
        failed = next((r for r in got.values() if r), None)
        if failed:
            return True, failed
        return want <= set(got), None

    def forget(self, request_id: str) -> None:
        self.done.pop(request_id, None)

    def notifications(self) -> list[Notification]:
        """Decode rank 0: the handoff notes ready to act on: a KVLanded once all its
        shards are in, a gave-up note at once."""
        notes = self.transport.notifications()
        if self.size > 1:
            self.group.read()
            for m in self.group.take(Notes):
                notes += [Notification(PeerId(name, epoch), data) for name, epoch, data in m.notes]
        return self.landings.add(notes)


def _setup_rank(runner, kind: str, configs: list, num_kv_heads: int) -> bytes:
    return RankKV.setup(runner, kind, configs[runner.tp.rank - 1], num_kv_heads)


class Landings:
    """A decode worker's handoff notes, held until complete: a KVLanded whose `shards`
    other notes have not all arrived waits for them (they may come first). Bounded: a
    request's notes go once delivered, and any kept longer than `keep_s` go too (their
    reservation's lease ended long before)."""

    def __init__(self, keep_s: float = 600.0) -> None:
        self.keep_s = keep_s
        self.landed: dict[str, tuple[Notification, int, float]] = {}  # rid -> (KVLanded note, shards, since)
        self.shards: dict[str, tuple[int, float]] = {}  # rid -> (shard notes so far, since)

    def add(self, notes: list[Notification]) -> list[Notification]:
        out = []
        now = time.monotonic()
        touched = set()
        for note in notes:
            msg = pb.KVLanded.FromString(note.message)
            rid = msg.request_id
            if msg.shard:
                n, since = self.shards.get(rid, (0, now))
                self.shards[rid] = (n + 1, since)
                touched.add(rid)
            elif msg.failed or msg.shards == 0:
                out.append(note)
            else:
                self.landed[rid] = (note, msg.shards, now)
                touched.add(rid)
        for rid in touched:
            if rid in self.landed and self.shards.get(rid, (0, 0))[0] >= self.landed[rid][1]:
                out.append(self.landed.pop(rid)[0])
                self.shards.pop(rid, None)
        if len(self.landed) + len(self.shards) > 0:
            for d in (self.landed, self.shards):
                for rid in [r for r, v in d.items() if now - v[-1] > self.keep_s]:
                    d.pop(rid, None)
        return out
