"""Which prefix blocks each worker holds, mirrored from its KV event stream, so the
router can send a prompt where most of it is already cached."""

from __future__ import annotations

from protos import tandem_pb2 as pb


class PrefixIndex:
    """Per worker, every block hash it holds, and which of them only below its device (in
    a KV tier: engine/kv_tiers.py), so routing can prefer the same prefix on a device."""

    def __init__(self) -> None:
        self._hashes: dict[str, set[bytes]] = {}
        self._below: dict[str, set[bytes]] = {}

    def apply(self, worker_id: str, batch: pb.KVEventBatch) -> None:
        held = self._hashes.setdefault(worker_id, set())
        below = self._below.setdefault(worker_id, set())
        if batch.cleared:
            held.clear()
            below.clear()
        held.difference_update(batch.removed)
        below.difference_update(batch.removed)
        held.update(batch.offloaded)
        below.update(batch.offloaded)
        held.update(batch.stored)  # after offloaded: a block restored in the same batch is on the device
        below.difference_update(batch.stored)

    def drop(self, worker_id: str) -> None:
        self._hashes.pop(worker_id, None)
        self._below.pop(worker_id, None)

    def overlap_below(self, worker_id: str, hashes: list[bytes], n: int) -> int:
        """Of the first `n` blocks of a prompt (a run the worker holds), those it holds only
        below its device."""
        below = self._below.get(worker_id)
        return sum(1 for h in hashes[:n] if h in below) if below else 0

    def overlap_blocks(self, worker_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt (chained hashes, in order) the worker has cached."""
        held = self._hashes.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
