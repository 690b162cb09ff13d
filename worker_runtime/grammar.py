"""Structured outputs' compiles in a worker process: on one thread of their own, never
on the engine thread (where a slow compile would pause every running stream) nor on the
gRPC event loop. The router has checked the spec already, bounded in size and time."""

from __future__ import annotations

import asyncio
import concurrent.futures

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputs, compile_matcher

_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")


async def matcher_for(structured: StructuredOutputs | None, params: SamplingParams):
    """The matcher `params` ask for (None without a spec); SamplingParamsError when its
    spec does not compile."""
    if params.guided is None:
        return None
    return await asyncio.get_running_loop().run_in_executor(_POOL, compile_matcher, structured, params.guided)
