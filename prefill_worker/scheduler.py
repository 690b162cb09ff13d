"""PrefillScheduler: the shared iteration-level scheduler, prefill-only.

Prompts are packed into `max_num_batched_tokens` per step (long ones chunked),
reusing prefix-cached blocks. A sequence ends its life here after its first token is
sampled: it moves to HANDOFF, still holding its blocks, until its KV has been
written to the decode worker; `end_handoff` then releases the blocks (which stay in
the prefix cache for later prompts).

    WAITING -> RUNNING (chunks) -> HANDOFF (transfer in flight) -> FINISHED
"""

from __future__ import annotations

from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, Status


class PrefillScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handoff: dict[str, Sequence] = {}

    def _append_token(self, seq: Sequence, tok: int) -> None:
        seq.output_ids.append(tok)
        self.running.remove(seq)
        seq.status = Status.HANDOFF
        self.handoff[seq.seq_id] = seq

    def end_handoff(self, seq_id: str, reason: FinishReason = FinishReason.LENGTH) -> Sequence | None:
        """The KV was written (or the write failed): release the blocks. Idempotent."""
        seq = self.handoff.get(seq_id)
        if seq is not None:
            self.finish(seq, reason)
        return seq

    def _drop_other(self, seq: Sequence) -> None:
        if seq.status is not Status.HANDOFF:
            super()._drop_other(seq)
        del self.handoff[seq.seq_id]

    def live(self) -> list[Sequence]:
        return [*super().live(), *self.handoff.values()]

    def check_integrity(self) -> None:
        assert all(s.status is Status.HANDOFF for s in self.handoff.values())
        super().check_integrity()
