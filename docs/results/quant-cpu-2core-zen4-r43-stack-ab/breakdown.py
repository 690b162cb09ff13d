"""One stream, offline: the median decode step of small-llama and, of it, the model's
forward (the one-call decode stack, the embedding and the final norm) and the LM head
(`compute_logits`), in ms; three 128-token answers to 256-token prompts, 2 threads.

    PYTHONPATH=. python docs/results/quant-cpu-2core-zen4-r43-stack-ab/breakdown.py int8   # or bf16

A second argument names the activations' dtype (bfloat16 unless given; float32 on a CPU
without native bf16, as in ../peers-small-cpu-2core-zen3-avx2-r45/).
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


def main(quant: str, dtype: str = "bfloat16") -> None:
    engine = LLMEngine.from_config(EngineConfig(
        model=MODEL, dtype=dtype, quantization=None if quant == "bf16" else quant,
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
    main(*(sys.argv[1:3] or ["int8"]))
