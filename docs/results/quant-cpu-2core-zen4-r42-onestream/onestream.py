"""One stream, offline: ms per decode step of small-llama, bf16 with and without the one-call
decode stack, and int8 (which has no such stack): where the int8 stream's time goes.

    PYTHONPATH=. python docs/results/quant-cpu-2core-zen4-r42-onestream/onestream.py
"""

import statistics
import time

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests.oracle import random_prompts

MODEL = "/root/peers/models/small-llama"


def measure(quant: str | None, stack: bool, reps: int = 3) -> float:
    """The best of `reps` medians of a 128-token answer's decode steps, in ms."""
    engine = LLMEngine.from_config(EngineConfig(
        model=MODEL, dtype="bfloat16", quantization=quant, device=DeviceConfig(num_threads=2),
        cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024)))
    model = engine.runner.model
    if not stack:  # the per-layer path, as if the one-call stack could not take the model
        model._stack_checked, model._stack = True, None
    best = []
    for r in range(reps):
        params = SamplingParams(max_tokens=129, temperature=0, ignore_eos=True)
        engine.add_request(f"r{r}", random_prompts([256], seed=r)[0], params)
        times = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        best.append(statistics.median(times[2:]) * 1e3)
    return min(best)


for quant, stack in ((None, True), (None, False), ("int8", True)):
    print(f"{quant or 'bf16'} stack={'on' if stack else 'off'}: {measure(quant, stack):.2f} ms/step", flush=True)
