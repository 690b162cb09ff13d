"""One stream, offline: the median decode step of small-llama and, of it, the model's
forward and the LM head (`compute_logits`), in ms; three 128-token answers to 256-token
prompts, 2 threads. The first argument the weights (int8, fp8, or none), the second the dtype.

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-zen3-avx2-r45/breakdown.py int8 bfloat16
"""

import functools
import statistics
import sys
import time

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests.oracle import random_prompts

MODEL = "/root/peers/models/small-llama"


def timed(obj, name: str, into: list[float]) -> None:
    """Wrap obj.name so that each call's seconds go to `into`."""
    f = getattr(obj, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        into.append(time.perf_counter() - t)
        return r

    setattr(obj, name, g)


def main(quant: str, dtype: str) -> None:
    engine = LLMEngine.from_config(EngineConfig(
        model=MODEL, dtype=dtype, quantization=None if quant == "none" else quant,
        device=DeviceConfig(num_threads=2), cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024)))
    model = engine.runner.model
    forward: list[float] = []
    logits: list[float] = []
    timed(model, "forward", forward)
    timed(model, "compute_logits", logits)
    for r in range(3):
        engine.add_request(f"r{r}", random_prompts([256], seed=r)[0],
                           SamplingParams(max_tokens=129, temperature=0, ignore_eos=True))
        forward.clear()
        logits.clear()
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        print(" ".join(f"{name} {statistics.median(v[2:]) * 1e3:.2f}"
                       for name, v in (("step", steps), ("forward", forward), ("logits", logits))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
