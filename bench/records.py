"""What the client records about one request: plain data, no I/O.

All times are seconds. `scheduled` and `sent` are offsets from the start of the timed
run; every other time is an offset from `sent` (the moment the HTTP request left).

    run start        scheduled    sent    chunk_times[0] ... chunk_times[-1]   finished
        |----------------|----------|------------|-----------------|---------------|
                          client_queue    TTFT          decode             stream tail
                                      |<-------------- e2e ----------------->|

`chunk_times[i]` is when the i-th *token-carrying* SSE event arrived and
`chunk_tokens[i]` how many tokens it carried (1 unless the server reported cumulative
usage per chunk). Events that carry no token (role-only deltas, a usage-only chunk, an
empty final chunk with `finish_reason`) are not in the timeline.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int
    category: str = "default"
    scheduled: float = 0.0
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finished: float = 0.0
    input_tokens: int = 0
    input_tokens_source: str = "spec"  # "usage" (server) | "spec" (workload's count)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" (server) | "chunks" (counted here)
    expected_output_tokens: int = 0
    output_chars: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    retries: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.ok and self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] if self.ok and self.chunk_times else None

    @property
    def end(self) -> float:
        """Offset from run start at which this request stopped occupying the client."""
        return self.sent + self.finished

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})
