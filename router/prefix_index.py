"""Which prefix blocks each worker holds, mirrored from its KV event stream, so the
router can send a prompt where most of it is already cached."""

from __future__ import annotations

from protos import tandem_pb2 as pb


class PrefixIndex:
    def __init__(self) -> None:
        self._hashes: dict[str, set[bytes]] = {}

    def apply(self, worker_id: str, batch: pb.KVEventBatch) -> None:
        held = self._hashes.setdefault(worker_id, set())
        if batch.cleared:
            held.clear()
        held.difference_update(batch.removed)
        held.update(batch.stored)

    def drop(self, worker_id: str) -> None:
        self._hashes.pop(worker_id, None)

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
