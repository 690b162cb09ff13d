"""What the OpenAI layer needs from whatever generates tokens.

`ClusterBackend` (router/cluster.py) routes each request over gRPC to Ray worker
pools; `EngineBackend` runs an AsyncEngine in this process (for `tandem generate`-
style use and for testing the HTTP layer on a real engine without a cluster). The
HTTP layer owns tokenization, chat templates, stop strings and response formats;
a backend sees token ids only.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.sampling_params import SamplingParams
from protos.tokens import TokenBatch


class BackendError(RuntimeError):
    """A request failed inside the serving system; `retry_after` set means overload."""

    def __init__(self, message: str, status: int = 500, retry_after: float | None = None,
                 full: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.full = full  # a worker refused it for room (RESOURCE_EXHAUSTED): nothing failed


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # engine.sequence.INTERACTIVE / BATCH
    output_ids: list[int] = field(default_factory=list)  # generated earlier (a migrated request)
    # the OpenTelemetry context its worker calls carry (worker_runtime/tracing.py); None: off
    trace: Any = None


class Backend(abc.ABC):
    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the backend up (workers started and healthy)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop every request and release resources; bounded in time."""

    @abc.abstractmethod
    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        """Stream the request's tokens. Raises BackendError before the first batch
        when it cannot be accepted (overload: status 429/503 with retry_after).
        Closing the iterator early aborts the request everywhere."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when a request sent now can be served."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Prompt plus output tokens a request may reach."""
