"""Structured outputs' compiles in a worker process: on one thread of their own, never
on the engine thread (where a slow compile would pause every running stream) nor on the
gRPC event loop. The router has checked the spec already, bounded in size and time;
the worker bounds its own compile by the same limits (`GrammarLimits`), as a request
may come from a router with other settings. A compile past its time is a 400 for its
request; its thread finishes it in the background (a native compile cannot be
stopped), and llguidance's own limits bound that work."""

from __future__ import annotations

import asyncio
import concurrent.futures

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured import StructuredOutputs, compile_matcher

_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")


async def matcher_for(structured: StructuredOutputs | None, params: SamplingParams):
    """The matcher `params` ask for (None without a spec); SamplingParamsError when its
    spec does not compile."""
    if params.guided is None:
        return None
    job = asyncio.get_running_loop().run_in_executor(_POOL, compile_matcher, structured, params.guided)
    timeout_s = structured.limits.compile_timeout_s if structured is not None else None
    try:
        return await asyncio.wait_for(job, timeout_s)
    except asyncio.TimeoutError:
        raise SamplingParamsError("response_format", f"the output spec does not compile within {timeout_s:g} s "
                                  "(--grammar-compile-timeout-s): simplify it") from None
