"""KV tiers below the device pool: host memory and local disk. The index: pure Python,
no torch. It decides where each block lives; the runner's store (engine/kv_offload.py)
moves the bytes, on every rank of a tensor-parallel worker, in the order decided here.

    device pool  --evicted (content hash)-->  host tier  --LRU-->  disk tier
                 <--restored before prefill-- host tier  <--fetched ahead-- disk tier

A block is known by the prefix cache's chained hash (engine/block_pool.py), so a block
that left the device can be found again by the next request with the same prefix.

Ownership: the device pool and the host tier are exclusive: an evicted device block
moves to a host slot, a restored host block moves back to a device block and its slot
is freed. The disk tier is inclusive, a content-addressed archive: a block spilled from
host memory keeps its file when it is fetched back (the same hash always names the same
bytes), so a second spill of it writes nothing. Every hit is checked against the
block's stored tokens (as the device cache does), and a disk file against its checksum,
its hash and its tokens: a torn, stale or foreign file is a miss, never wrong tokens.

Swap (vLLM's `--swap-space`): a preempted sequence's full blocks get a reserved host
budget of their own. They stay in the device pool, evictable, as any released blocks
(most likely still there when the sequence resumes, then no copy at all); a device
eviction of one moves it into that budget, pinned to the sequence until it resumes or
ends, out of the host LRU's reach. A sequence is swapped where the measured copy time
of its blocks is below the measured time to recompute its tokens, else recomputed. Its
last, partial block is recomputed either way (fewer than block_size tokens, computed
in the same step as the one token a resumed sequence must compute anyway).

Moves, in the order they must run (a later move may reuse a slot or block an earlier
one freed):
    ("save", block, slot)             device block -> host slot
    ("load", slot, block)             host slot -> device block
    ("spill", slot, key, tokens)      host slot -> disk file (written in the background)
    ("fetch", key, slot, tokens)      disk file -> host slot (read in the background)
    ("unlink", key)                   delete a disk file
The tier on a worker's restart: gone. Host memory goes with the process; the disk
tier's directory is emptied when a store opens it (its files are one run's).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

# how long a request waits for its prefix to come up from disk before it computes it instead
FETCH_WAIT_S = 10.0


@dataclass
class _HostEntry:
    slot: int
    tokens: tuple[int, ...]
    pinned_by: str | None = None  # a swapped-out sequence's id


@dataclass
class _Fetch:
    slot: int
    tokens: tuple[int, ...]
    started: float


@dataclass
class TierStats:
    """Counts since start, in blocks (bytes = blocks x the worker's bytes per block)."""

    host_saves: int = 0  # device -> host
    host_hits: int = 0  # host -> device, for a prefix hit or a swap-in
    disk_spills: int = 0  # host -> disk (files written)
    disk_fetches: int = 0  # disk -> host, read and verified
    disk_hits: int = 0  # of host_hits, the blocks that had come up from disk
    disk_errors: int = 0  # files that failed their check (or could not be read): misses
    host_dropped: int = 0  # left host memory with no lower tier to take them
    queries: int = 0  # blocks looked up below the device (a device miss)
    swap_outs: int = 0  # preempted sequences swapped
    recomputes: int = 0  # preempted sequences left to recompute (the cost model's choice)
    restore_s: float = 0.0  # host -> device copy time on the host (CPU: the copy; CUDA: its launch)
    fetch_s: float = 0.0  # disk fetches' time, summed (each in the background)


class CostModel:
    """Swap or recompute: the copy rate of the tier moves and the prefill rate, each a
    moving average of what this worker measured (before the first measure, a guess
    that favours swapping: a copy of KV is about 100x cheaper per token than its compute
    on every device tandem runs on)."""

    def __init__(self, copy_bytes_per_s: float = 5e9, prefill_tokens_per_s: float = 0.0) -> None:
        self.copy_bytes_per_s = copy_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s = 0.8 * self.copy_bytes_per_s + 0.2 * (num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            rate = num_tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                0.8 * self.prefill_tokens_per_s + 0.2 * rate

    def swap_cheaper(self, num_blocks: int, block_bytes: int, num_tokens: int) -> bool:
        """Out and back in, against computing `num_tokens` again."""
        if not self.prefill_tokens_per_s:
            return True
        return 2 * num_blocks * block_bytes / self.copy_bytes_per_s < num_tokens / self.prefill_tokens_per_s


class TierIndex:
    """Where the blocks below the device pool are, and the moves that put them there.

    `host_blocks`: the host tier's LRU budget; `swap_blocks`: the budget for swapped
    sequences' blocks (host slots = both); `disk_blocks`: the disk tier (0: none; it is
    fed from the host tier, so it needs `host_blocks`). `on_device(h)`: whether the
    device pool holds hash h (a block leaving every tier is reported removed only
    then). `events`: the pool's event list, for "removed" when a block leaves the worker.
    """

    def __init__(self, block_size: int, block_bytes: int, host_blocks: int, swap_blocks: int = 0,
                 disk_blocks: int = 0, on_device: Callable[[bytes], bool] = lambda h: False,
                 emit_removed: Callable[[bytes], None] = lambda h: None) -> None:
        if min(host_blocks, swap_blocks, disk_blocks) < 0:
            raise ValueError("tier sizes must be >= 0")
        if disk_blocks and not host_blocks:
            raise ValueError("the disk tier is fed from the host tier: give the host tier blocks too")
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.host_blocks = host_blocks
        self.swap_blocks = swap_blocks
        self.disk_blocks = disk_blocks
        self.num_slots = host_blocks + swap_blocks
        self._on_device = on_device
        self._emit_removed = emit_removed
        self._host: OrderedDict[bytes, _HostEntry] = OrderedDict()  # oldest first
        self._free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._num_pinned = 0
        self._fetching: dict[bytes, _Fetch] = {}
        self._disk: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # oldest first
        self._swap_of: dict[bytes, str] = {}  # hash -> the swapped-out sequence it belongs to
        self._swapped: dict[str, list[bytes]] = {}
        self._from_disk: set[bytes] = set()  # host blocks that came up from disk, not yet restored
        self._held: dict[bytes, _HostEntry] = {}  # between `hold` and `restore`
        self.moves: list[tuple] = []
        self.stats = TierStats()
        self.cost = CostModel()

    # ---- queries ---------------------------------------------------------------
    @property
    def num_host_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def num_disk_used(self) -> int:
        return len(self._disk)

    @property
    def num_fetching(self) -> int:
        return len(self._fetching)

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    def hashes(self) -> list[bytes]:
        """Every hash this worker holds below its device pool."""
        return [*self._host, *(h for h in self._disk if h not in self._host)]

    def holds(self, h: bytes) -> bool:
        return h in self._host or h in self._disk or h in self._fetching or h in self._held

    def host_run(self, hashes: Sequence[bytes], tokens_of: Callable[[int], tuple[int, ...]]) -> int:
        """How many of `hashes` (leading) are in host memory with these tokens."""
        n = 0
        for i, h in enumerate(hashes):
            e = self._host.get(h)
            if e is None or e.tokens != tokens_of(i):
                break
            n += 1
        return n

    def fetch_run(self, hashes: Sequence[bytes], tokens_of: Callable[[int], tuple[int, ...]],
                  now: float | None = None) -> tuple[bool, int]:
        """For `hashes` past the host hits: (whether some of them are coming up from disk
        now, within FETCH_WAIT_S, so that waiting pays; how many leading ones are on
        disk and not yet fetched)."""
        now = time.monotonic() if now is None else now
        pending = False
        n = 0
        for i, h in enumerate(hashes):
            f = self._fetching.get(h)
            if f is not None:
                if f.tokens != tokens_of(i) or now - f.started > FETCH_WAIT_S:
                    break
                pending = True
                continue
            t = self._disk.get(h)
            if t is None or t != tokens_of(i) or h in self._host:
                break
            n = i + 1
        return pending, n

    # ---- device evictions --------------------------------------------------------
    def offer(self, block: int, h: bytes, tokens: Sequence[int]) -> bool:
        """The device pool evicts `block` (named `h`): keep it below if a tier takes it
        (a "save" move queued; the caller must run the moves before the block is
        written again). False: it left the worker."""
        e = self._host.get(h)
        if e is not None:  # already here (a copy the device had computed again): nothing to move
            self._host.move_to_end(h)
            return True
        owner = self._swap_of.get(h)
        pinned = owner if owner is not None and self._num_pinned < self.swap_blocks else None
        if pinned is None and not self.host_blocks:
            return h in self._disk  # no room in host memory: only a file, if one holds it, keeps it here
        slot = self._take_slot(pinned=pinned is not None)
        if slot is None:
            return h in self._disk
        if pinned is not None:
            self._num_pinned += 1
        self._host[h] = _HostEntry(slot, tuple(tokens), pinned)
        self.moves.append(("save", block, slot))
        self.stats.host_saves += 1
        return True

    def _take_slot(self, pinned: bool) -> int | None:
        """A free host slot for one more block, within its budget (a pinned one within the
        swap budget, checked by the caller), evicting the oldest unpinned block when the
        LRU budget is full."""
        if not pinned:
            while self._num_unpinned() >= self.host_blocks:
                if not self._evict_oldest():
                    return None
        if not self._free_slots:
            return None
        return self._free_slots.pop()

    def _num_unpinned(self) -> int:
        """Slots the LRU budget counts: ordinary host blocks, those being fetched, and those
        held for a restore (they keep their slots until the load is queued)."""
        return len(self._host) - self._num_pinned + len(self._fetching) + len(self._held)

    def _evict_oldest(self, protect: frozenset | set = frozenset()) -> bool:
        victim = next((h for h, e in self._host.items() if e.pinned_by is None and h not in protect), None)
        if victim is None:
            return False
        self._drop_host(victim, spill=True, protect=protect)
        return True

    def _drop_host(self, h: bytes, spill: bool, protect: frozenset | set = frozenset()) -> None:
        e = self._host.pop(h)
        self._from_disk.discard(h)
        if e.pinned_by is not None:
            self._num_pinned -= 1
        if spill and self.disk_blocks:
            if h in self._disk:
                self._disk.move_to_end(h)
            elif self._make_disk_room(protect):
                self._disk[h] = e.tokens
                self.moves.append(("spill", e.slot, h, e.tokens))
                self.stats.disk_spills += 1
            else:
                self.stats.host_dropped += 1
        elif spill:
            self.stats.host_dropped += 1
        self._free_slots.append(e.slot)
        if not self.holds(h) and not self._on_device(h):
            self._emit_removed(h)

    def _make_disk_room(self, protect: frozenset | set) -> bool:
        """Room for one more file: the oldest files go, except those of `protect` (a
        prefix being fetched) and those being read."""
        while len(self._disk) >= self.disk_blocks:
            victim = next((d for d in self._disk if d not in protect and d not in self._fetching), None)
            if victim is None:
                return False
            del self._disk[victim]
            self.moves.append(("unlink", victim))
            if not self.holds(victim) and not self._on_device(victim):
                self._emit_removed(victim)
        return True

    # ---- restores ------------------------------------------------------------------
    def hold(self, hashes: Sequence[bytes]) -> None:
        """Take these host blocks out of the LRU's reach until `restore` (the device blocks
        they go to are being allocated, and those allocations evict into host memory)."""
        for h in hashes:
            e = self._host.pop(h)
            if e.pinned_by is not None:
                self._num_pinned -= 1
            self._held[h] = e

    def restore(self, h: bytes, block: int) -> None:
        """Move host block `h` (held) into device `block` (a "load" move; its slot is free
        after it)."""
        e = self._held.pop(h)
        self.moves.append(("load", e.slot, block))
        self._free_slots.append(e.slot)
        self.stats.host_hits += 1
        if h in self._from_disk:
            self._from_disk.discard(h)
            self.stats.disk_hits += 1

    def prefetch(self, hashes: Sequence[bytes], protect: Sequence[bytes] = (), now: float | None = None) -> int:
        """Start bringing these disk blocks up to host memory, in order, as many as the
        host LRU budget has room for without evicting `protect` (the host blocks of the
        same prefix, before these) or one another. Returns how many were started."""
        now = time.monotonic() if now is None else now
        started = 0
        keep = set(protect) | set(hashes)
        for h in hashes:
            if h in self._fetching or h in self._host:
                continue
            tokens = self._disk.get(h)
            if tokens is None:
                break
            self._disk.move_to_end(h)
            if self._num_unpinned() >= self.host_blocks and not self._evict_oldest(keep):
                break
            if not self._free_slots:
                break
            slot = self._free_slots.pop()
            self._fetching[h] = _Fetch(slot, tokens, now)
            self.moves.append(("fetch", h, slot, tokens))
            started += 1
        return started

    def fetched(self, h: bytes, ok: bool, seconds: float = 0.0) -> None:
        """A fetch ended (on every rank): the block is in host memory, or its file was bad
        (then it is forgotten, the file deleted)."""
        f = self._fetching.pop(h, None)
        if f is None:
            return
        if ok:
            self.stats.disk_fetches += 1
            self.stats.fetch_s += seconds
            self._host[h] = _HostEntry(f.slot, f.tokens, None)
            self._from_disk.add(h)
            while self._num_unpinned() > self.host_blocks and self._evict_oldest():
                pass
            return
        self.stats.disk_errors += 1
        self._free_slots.append(f.slot)
        if self._disk.pop(h, None) is not None:
            self.moves.append(("unlink", h))
        if not self.holds(h) and not self._on_device(h):
            self._emit_removed(h)

    # ---- swap ------------------------------------------------------------------------
    def swap_out(self, seq_id: str, hashes: Sequence[bytes], num_tokens: int) -> bool:
        """A sequence is preempted with these full blocks named: reserve them the swap
        budget where swapping is cheaper than recomputing `num_tokens`. Returns whether it
        is swapped."""
        if not self.swap_blocks or not hashes:
            return False
        if not self.cost.swap_cheaper(len(hashes), self.block_bytes, num_tokens):
            self.stats.recomputes += 1
            return False
        self.unpin(seq_id)
        for h in hashes:
            self._swap_of[h] = seq_id
        self._swapped[seq_id] = list(hashes)
        self.stats.swap_outs += 1
        return True

    def unpin(self, seq_id: str) -> None:
        """The sequence resumed or ended: its blocks below the device are ordinary ones."""
        hashes = self._swapped.pop(seq_id, None)
        if not hashes:
            return
        for h in hashes:
            if self._swap_of.get(h) == seq_id:
                del self._swap_of[h]
            e = self._host.get(h)
            if e is not None and e.pinned_by == seq_id:
                e.pinned_by = None
                self._num_pinned -= 1
        while self._num_unpinned() > self.host_blocks and self._evict_oldest():
            pass

    # ---- the rest -----------------------------------------------------------------------
    def take_moves(self) -> list[tuple]:
        moves, self.moves = self.moves, []
        return moves

    def clear(self) -> int:
        """Forget every block below the device (an admin's prefix-cache reset); the
        files go too. In-flight fetches end as misses. Returns how many were dropped."""
        n = len(self._host) + len(self._disk)
        for h in list(self._host):
            e = self._host.pop(h)
            self._free_slots.append(e.slot)
        self._num_pinned = 0
        for h in list(self._disk):
            self.moves.append(("unlink", h))
        self._disk.clear()
        self._swap_of.clear()
        self._swapped.clear()
        self._from_disk.clear()
        return n

    def check_integrity(self) -> None:
        assert not self._held, "host blocks held past their restore"
        slots = [e.slot for e in self._host.values()] + [f.slot for f in self._fetching.values()]
        assert len(set(slots)) == len(slots), "a host slot holds two blocks"
        assert not set(slots) & set(self._free_slots), "a host slot both used and free"
        assert len(slots) + len(self._free_slots) == self.num_slots, "host slots lost"
        pinned = sum(1 for e in self._host.values() if e.pinned_by is not None)
        assert pinned == self._num_pinned <= self.swap_blocks, f"pinned {pinned} / {self._num_pinned}"
        assert self._num_unpinned() <= self.host_blocks, "host LRU over its budget"
        assert len(self._disk) <= self.disk_blocks, "disk tier over its budget"
        assert not set(self._host) & set(self._fetching), "a block both in host memory and being fetched"
