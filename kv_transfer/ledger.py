"""The KV handoff ledger: one state machine per request, on both sides of a transfer.
It is the one owner of a handoff's state and deadlines; the schedulers and services
derive what they hold from it.

::

    RESERVED --> WRITING --> READY --> RUNNING --> DONE
        |           |          |          |
        +-----------+----------+----------+-----> FAILED   (fail / release / drop_peer)
        +-----------+----------+----------------> EXPIRED  (sweep: lease ran out)
        +---------------------> READY                       (the receiver may not see WRITING)
                                   +------------> DONE      (the sender: its part is over)
        |           |
        +-----------+--> QUARANTINED --> FAILED   (writer_done: the late writer finished)
                              +--------> EXPIRED  (sweep: the quarantine ran out)

Decode side: `reserve` blocks for the incoming KV, `mark_ready` on the
transport's notification, `start_running` when the request joins the batch,
`finish` when it ends. Prefill side: `reserve` the source blocks, `start_writing`,
`mark_ready` when the write is acknowledged, `finish` once the peer took over.

Quarantine (a ledger made with `quarantine_s`, i.e. the decode side): KV is pushed
into this worker's blocks, so a reservation that ends (fail, or its lease runs out)
while a write may still be on its way cannot free its blocks at once: another
request could reuse them and be overwritten. It moves to QUARANTINED instead: the
request is over (`on_quarantine` runs once), the blocks stay held until the writer's
notification for that request arrives (`writer_done`) or `quarantine_s` passes.

Invariants:
- RESERVED, WRITING, READY and QUARANTINED hold a deadline; `sweep` acts on it.
  Every leased transition renews the lease. RUNNING holds none: its owner ends it.
- DONE, FAILED, EXPIRED are terminal. Entering one calls `on_free(entry)`
  exactly once; any later done/fail/expire/release of that entry is a no-op.
- FAILED, EXPIRED and QUARANTINED always carry a reason.
- With `exclusive_blocks`, no block id belongs to two live entries.

Pure Python; not thread-safe (use it from the worker's engine thread).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable


class HandoffState(enum.Enum):
    RESERVED = "RESERVED"
    WRITING = "WRITING"
    READY = "READY"
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"
    EXPIRED = "EXPIRED"
    QUARANTINED = "QUARANTINED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def leased(self) -> bool:
        return self in _LEASED


S = HandoffState
_TERMINAL = frozenset({S.DONE, S.FAILED, S.EXPIRED})
_LEASED = frozenset({S.RESERVED, S.WRITING, S.READY, S.QUARANTINED})
# the states in which a peer may still be writing into this side's blocks
_WRITABLE = frozenset({S.RESERVED, S.WRITING})
ALLOWED: dict[HandoffState, frozenset[HandoffState]] = {
    S.RESERVED: frozenset({S.WRITING, S.READY, S.FAILED, S.EXPIRED, S.QUARANTINED}),
    S.WRITING: frozenset({S.READY, S.FAILED, S.EXPIRED, S.QUARANTINED}),
    S.READY: frozenset({S.RUNNING, S.DONE, S.FAILED, S.EXPIRED}),
    S.RUNNING: frozenset({S.DONE, S.FAILED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset(),
    S.EXPIRED: frozenset(),
    S.QUARANTINED: frozenset({S.FAILED, S.EXPIRED}),
}


class LedgerError(RuntimeError):
    """Misuse of the ledger; the message names the request."""


class IllegalTransition(LedgerError):
    """A transition the state machine does not allow (named: request, from, to)."""


class UnknownRequest(LedgerError, KeyError):
    """The request id is neither live nor in the recent history."""


@dataclass
class Entry:
    """One request's handoff. `blocks` are this worker's block ids; `peer` is the
    other side's incarnation (e.g. a PeerId), so a dead peer can be dropped."""

    request_id: str
    blocks: tuple[int, ...]
    peer: Hashable | None
    state: HandoffState
    lease_s: float
    deadline: float | None
    created_at: float
    updated_at: float
    reason: str = ""
    freed: bool = False


class Ledger:
    """Live entries plus a bounded history of finished ones (so a late, repeated
    fail/finish on a recent request is still recognised as a no-op)."""

    def __init__(
        self,
        on_free: Callable[[Entry], None],
        default_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        history: int = 4096,
        exclusive_blocks: bool = True,
        quarantine_s: float | None = None,
        on_quarantine: Callable[[Entry], None] | None = None,
    ) -> None:
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s must be > 0, got {default_lease_s}")
        if quarantine_s is not None and quarantine_s <= 0:
            raise ValueError(f"quarantine_s must be > 0 (or None: no quarantine), got {quarantine_s}")
        self._on_free = on_free
        self._quarantine_s = quarantine_s
        self._on_quarantine = on_quarantine
        self._default_lease_s = default_lease_s
        self._clock = clock
        self._history = history
        self._exclusive = exclusive_blocks
        self._live: dict[str, Entry] = {}
        self._finished: OrderedDict[str, Entry] = OrderedDict()
        self._by_peer: dict[Hashable, set[str]] = {}
        self._block_owner: dict[int, str] = {}

    # -- queries -----------------------------------------------------------

    def get(self, request_id: str) -> Entry | None:
        return self._live.get(request_id) or self._finished.get(request_id)

    def live(self) -> list[Entry]:
        return list(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    def count(self, *states: HandoffState) -> int:
        """Live entries in any of `states`."""
        return sum(e.state in states for e in self._live.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    # -- transitions ---------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        blocks: Iterable[int],
        peer: Hashable | None = None,
        lease_s: float | None = None,
    ) -> Entry:
        """A new RESERVED entry; a finished entry with the same id (a retry) is replaced."""
        if request_id in self._live:
            raise LedgerError(
                f"request {request_id!r} is already live ({self._live[request_id].state.name})"
            )
        blocks = tuple(blocks)
        if self._exclusive:
            taken = [b for b in blocks if b in self._block_owner]
            if taken:
                owner = self._block_owner[taken[0]]
                raise LedgerError(
                    f"request {request_id!r}: block {taken[0]} is held by request {owner!r}"
                )
        now = self._clock()
        lease = self._default_lease_s if lease_s is None else lease_s
        entry = Entry(request_id, blocks, peer, S.RESERVED, lease, now + lease, now, now)
        self._finished.pop(request_id, None)
        self._live[request_id] = entry
        self._by_peer.setdefault(peer, set()).add(request_id)
        if self._exclusive:
            self._block_owner.update((b, request_id) for b in blocks)
        return entry

    def start_writing(self, request_id: str, lease_s: float | None = None) -> Entry:
        return self._move(request_id, S.WRITING, lease_s=lease_s)

    def mark_ready(self, request_id: str, lease_s: float | None = None) -> Entry:
        return self._move(request_id, S.READY, lease_s=lease_s)

    def start_running(self, request_id: str) -> Entry:
        return self._move(request_id, S.RUNNING)

    def finish(self, request_id: str) -> Entry:
        """DONE (frees); a no-op on an entry already terminal."""
        return self._move(request_id, S.DONE)

    def fail(self, request_id: str, reason: str, writer_done: bool = False) -> Entry:
        """FAILED with `reason` (frees); QUARANTINED instead while a write may still
        land (see the module docstring) unless `writer_done`. A no-op on an entry
        already terminal or quarantined."""
        if not reason:
            raise ValueError(f"request {request_id!r}: a failure needs a reason")
        entry = self._require(request_id)
        if entry.state is S.QUARANTINED:
            return self.writer_done(request_id) if writer_done else entry
        if not writer_done and self._quarantines(entry):
            return self._quarantine(entry, reason)
        return self._move(request_id, S.FAILED, reason=reason)

    def writer_done(self, request_id: str) -> Entry:
        """The writer's notification for a quarantined entry arrived: nothing more can
        land in its blocks, so it ends FAILED (frees). A no-op in any other state."""
        entry = self._require(request_id)
        if entry.state is not S.QUARANTINED:
            return entry
        return self._move(request_id, S.FAILED, reason=entry.reason)

    def release(self, request_id: str, reason: str = "released by its owner") -> Entry:
        """Cancel (client gone, request retried elsewhere): FAILED, frees; idempotent."""
        return self.fail(request_id, f"released: {reason}")

    def extend(self, request_id: str, lease_s: float | None = None) -> Entry:
        """Renew the lease of a leased entry without changing its state."""
        entry = self._require(request_id)
        if not entry.state.leased:
            raise IllegalTransition(
                f"request {request_id!r}: cannot extend a lease in state {entry.state.name}"
            )
        self._renew(entry, lease_s)
        return entry

    def sweep(self, now: float | None = None) -> list[Entry]:
        """Act on every deadline that has passed: a leased request's lease ran out
        (EXPIRED, or QUARANTINED where a write may still land): returned; a
        quarantine ran out (EXPIRED, frees): not returned, that request ended earlier."""
        now = self._clock() if now is None else now
        overdue = [e for e in self._live.values() if e.deadline is not None and e.deadline <= now]
        ended = []
        for entry in overdue:
            if entry.state is S.QUARANTINED:
                self._move(entry.request_id, S.EXPIRED, reason=entry.reason, now=now)
                continue
            reason = f"lease of {entry.lease_s:g} s ran out in state {entry.state.name}"
            if self._quarantines(entry):
                self._quarantine(entry, reason, now)
            else:
                self._move(entry.request_id, S.EXPIRED, reason=reason, now=now)
            ended.append(entry)
        return ended

    def drop_peer(self, peer: Hashable, reason: str | None = None) -> list[Entry]:
        """Fail every live entry tied to `peer` (that incarnation is gone); returns them."""
        dropped = [self._live[rid] for rid in sorted(self._by_peer.get(peer, ()))]
        for entry in dropped:
            self.fail(entry.request_id, reason or f"peer {peer} is gone")
        return dropped

    # -- mechanism -------------------------------------------------------------

    def _require(self, request_id: str) -> Entry:
        entry = self.get(request_id)
        if entry is None:
            raise UnknownRequest(f"request {request_id!r} is not in the ledger")
        return entry

    def _quarantines(self, entry: Entry) -> bool:
        return self._quarantine_s is not None and entry.state in _WRITABLE

    def _quarantine(self, entry: Entry, reason: str, now: float | None = None) -> Entry:
        self._move(entry.request_id, S.QUARANTINED, reason=reason, lease_s=self._quarantine_s, now=now)
        if self._on_quarantine is not None:
            self._on_quarantine(entry)
        return entry

    def _move(
        self,
        request_id: str,
        to: HandoffState,
        reason: str = "",
        lease_s: float | None = None,
        now: float | None = None,
    ) -> Entry:
        entry = self._require(request_id)
        if entry.state.terminal and to.terminal:
            return entry  # idempotent: the first terminal transition won and freed
        if to not in ALLOWED[entry.state]:
            detail = f" (it ended: {entry.reason})" if entry.reason else ""
            raise IllegalTransition(
                f"request {request_id!r}: {entry.state.name} -> {to.name} is not allowed{detail}"
            )
        entry.state = to
        entry.updated_at = self._clock() if now is None else now
        if to.leased:
            self._renew(entry, lease_s, entry.updated_at)
        else:
            entry.deadline = None
        if to.terminal or to is S.QUARANTINED:
            entry.reason = reason
        if to.terminal:
            self._retire(entry)
        return entry

    def _renew(self, entry: Entry, lease_s: float | None, now: float | None = None) -> None:
        if lease_s is not None:
            entry.lease_s = lease_s
        entry.deadline = (self._clock() if now is None else now) + entry.lease_s

    def _retire(self, entry: Entry) -> None:
        """Move a just-terminated entry to the history and free its blocks, once."""
        rid = entry.request_id
        del self._live[rid]
        peers = self._by_peer[entry.peer]
        peers.discard(rid)
        if not peers:
            del self._by_peer[entry.peer]
        if self._exclusive:
            for b in entry.blocks:
                self._block_owner.pop(b, None)
        self._finished[rid] = entry
        while len(self._finished) > self._history:
            self._finished.popitem(last=False)
        entry.freed = True  # set first: a raising callback must not lead to a second free
        self._on_free(entry)

    def check_integrity(self) -> None:
        """Raise LedgerError if any invariant in the module docstring is broken."""
        problems = []
        for rid, e in self._live.items():
            if e.state.terminal or e.freed:
                problems.append(f"live {rid!r} is {e.state.name} (freed={e.freed})")
            if e.state.leased != (e.deadline is not None):
                problems.append(f"live {rid!r} in {e.state.name} has deadline {e.deadline}")
            if e.state is S.QUARANTINED and not e.reason:
                problems.append(f"live {rid!r} is QUARANTINED without a reason")
            if rid in self._finished:
                problems.append(f"{rid!r} is both live and finished")
        for rid, e in self._finished.items():
            if not (e.state.terminal and e.freed):
                problems.append(f"finished {rid!r} is {e.state.name} (freed={e.freed})")
            if e.state is not S.DONE and not e.reason:
                problems.append(f"finished {rid!r} is {e.state.name} without a reason")
        index = {p: set(rids) for p, rids in self._by_peer.items()}
        expect: dict[Hashable, set[str]] = {}
        for rid, e in self._live.items():
            expect.setdefault(e.peer, set()).add(rid)
        if index != expect:
            problems.append(f"peer index {index} != live entries by peer {expect}")
        if self._exclusive:
            owners = {b: rid for rid, e in self._live.items() for b in e.blocks}
            if owners != self._block_owner or sum(
                len(e.blocks) for e in self._live.values()
            ) != len(owners):
                problems.append("a block is held by two live entries, or the block index is stale")
        if problems:
            raise LedgerError("ledger integrity: " + "; ".join(problems))
