"""EngineBackend: the HTTP layer over an AsyncEngine in this process (no cluster)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from decode_worker.async_engine import AsyncEngine
from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.events import Usage
from engine.sampling_params import SamplingParamsError
from engine.scheduler import AdmissionError
from protos.tokens import TokenBatch
from router.backend import Backend, BackendError, GenerateRequest


def _batch(ev) -> TokenBatch:
    u = ev.usage or Usage()
    return TokenBatch(
        first_index=ev.completion_tokens - (ev.token_id is not None),
        token_ids=[] if ev.token_id is None else [ev.token_id],
        logprobs=[] if ev.logprobs is None else [ev.logprobs],
        finished=ev.finished,
        finish_reason=ev.finish_reason.value if ev.finish_reason else None,
        error=ev.error,
        prompt_tokens=u.prompt_tokens,
        cached_tokens=u.cached_tokens,
        completion_tokens=u.completion_tokens,
        prompt_logprobs=ev.prompt_logprobs,
        draft_tokens=u.draft_tokens,
        accepted_tokens=u.accepted_tokens,
    )


class EngineBackend(Backend):
    def __init__(self, config: EngineConfig, max_queued: int = 1024) -> None:
        self.config = config
        self.max_queued = max_queued
        self.aengine: AsyncEngine | None = None

    async def start(self) -> None:
        import asyncio

        engine = await asyncio.to_thread(LLMEngine.from_config, self.config)
        self.aengine = AsyncEngine(engine)
        self.aengine.start()

    async def stop(self) -> None:
        if self.aengine is not None:
            self.aengine.stop()

    def ready(self) -> bool:
        return self.aengine is not None and self.aengine.healthy

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        if not self.ready():
            raise BackendError("engine is not ready", 503, retry_after=1.0)
        sched = self.aengine.engine.scheduler
        if sched.num_waiting >= self.max_queued:
            raise BackendError("too many requests queued", 429, retry_after=1.0)
        try:
            stream = self.aengine.generate(req.request_id, req.prompt_ids, req.params, req.priority)
            async with contextlib.aclosing(stream):
                async for ev in stream:
                    yield _batch(ev)
        except AdmissionError as e:
            raise BackendError(str(e), 400) from e
        except SamplingParamsError as e:  # as a decode worker answers it: INVALID_ARGUMENT, a 400
            raise BackendError(f"{e.param}: {e}", 400) from e
