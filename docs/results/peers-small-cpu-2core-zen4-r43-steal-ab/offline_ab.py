"""Offline A/B of the stealing weight streams (engine/cpu_kernels/steal.h) in one process:
one LLMEngine on small-llama with --quantization int8, 2 threads; answers of 64 tokens to
256-token prompts, the stream's mode switched between answers (`set_work_stealing`),
in alternating order; prints each mode's median decode steps in ms.

    PYTHONPATH=. python docs/results/peers-small-cpu-2core-zen4-r43-steal-ab/offline_ab.py 8
    # beside two busy processes, together about a fifth of a core (then the line above):
    python docs/results/peers-small-cpu-2core-zen4-r43-steal-ab/offline_ab.py --burn 0.3 3 90 &
    python docs/results/peers-small-cpu-2core-zen4-r43-steal-ab/offline_ab.py --burn 0.2 2 90 &
"""

import statistics
import sys
import time

MODEL = "/root/peers/models/small-llama"


def burn(busy_ms: float, period_ms: float, seconds: float) -> None:
    """Busy for `busy_ms` out of every `period_ms`, for `seconds`."""
    busy, period, end = busy_ms / 1e3, period_ms / 1e3, time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(max(0.0, period - busy))


def main(rounds: int) -> None:
    from decode_worker.llm_engine import EngineConfig, LLMEngine
    from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams
    from tests.oracle import random_prompts

    engine = LLMEngine.from_config(EngineConfig(
        model=MODEL, dtype="bfloat16", quantization="int8", device=DeviceConfig(num_threads=2),
        cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024)))
    res: dict[str, list[float]] = {"steal": [], "fixed": []}
    for r in range(rounds):
        for mode in ("steal", "fixed") if r % 2 == 0 else ("fixed", "steal"):
            engine.runner.model.cpu_ops.set_work_stealing(mode == "steal")
            engine.add_request(f"r{r}{mode}", random_prompts([256], seed=r)[0],
                               SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
            times = []
            while engine.has_work():
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            res[mode].append(statistics.median(times[2:]) * 1e3)
    for k, v in res.items():
        print(f"{k}: mean {statistics.mean(v):.2f} ms  " + " ".join(f"{x:.2f}" for x in v))


if __name__ == "__main__":
    if sys.argv[1] == "--burn":
        burn(*map(float, sys.argv[2:5]))
    else:
        main(int(sys.argv[1]))
