"""The host's share of an engine step, without the forward pass: how long the scheduler,
the input building and the retiring take per step for B decoding sequences.

    python -m bench.lab.hostpath [--batches 32 256] [--context 16 1024] [--steps 300] [--model DIR]

B sequences with prompts of --context tokens are admitted and prefilled through the real
engine (LLMEngine on CPU), then --steps decode steps run their host parts alone, each timed:
`Scheduler.schedule`, `ModelRunner._prepare` (the step's tensors: token ids, positions,
slots, block tables) and `LLMEngine._finish` (the scheduler's update and the token events),
with every sequence handed the same token; and `Scheduler.schedule_ahead` (asynchronous
scheduling's plan of the next step) on separate steps. Medians in microseconds per step.

These parts run on the engine's thread between forward passes. On a GPU they are what
the device waits for (synchronous steps) or what must fit under its forward pass
(asynchronous scheduling): docs/performance.md, thirtieth round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.hostpath", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in model)")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    p.add_argument("--context", type=int, nargs="+", default=[16, 1024], help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per case")
    return p.parse_args(argv)


def measure(model: str | None, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median microseconds per step of each host part (see the module's doc)."""
    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from engine.runner import StepResult
    from engine.sampling_params import SamplingParams

    ahead_steps = max(steps // 3, 1)
    # sequences already decode while later prompts are prefilled: room for those tokens too
    prefill_steps = -(-batch * context // 2048) + batch
    max_len = context + prefill_steps + steps + ahead_steps + 8
    engine = LLMEngine.from_config(EngineConfig(
        model=model, dtype="float32",
        cache=CacheConfig(num_blocks=batch * (-(-max_len // 16) + 1) + 16, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
                                  max_model_len=max_len),
        device=DeviceConfig(device="cpu")))
    params = SamplingParams(max_tokens=max_len - context, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [5 + (i + j) % 100 for j in range(context)], params)
    sch, runner = engine.scheduler, engine.runner
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "finish": [], "schedule_ahead": []}
    clock = time.perf_counter

    def retire(out, sample_ids) -> list:
        result = StepResult(dict.fromkeys(sample_ids, 7), dict.fromkeys(sample_ids), 0.0, out.plan.num_tokens)
        t0 = clock()
        events = engine._finish(out, result)
        times["finish"].append(clock() - t0)
        return events

    with torch.inference_mode():
        while sch.num_waiting or any(s.num_to_compute > 1 for s in sch.running):  # prompts, with real forwards
            engine.step()
        for _ in range(steps):
            t0 = clock()
            out = sch.schedule()
            t1 = clock()
            b = runner._prepare(out.plan)
            times["schedule"].append(t1 - t0)
            times["prepare"].append(clock() - t1)
            if len(retire(out, b.sample_ids)) != batch:
                raise RuntimeError("a step did not retire every sequence")
        for _ in range(ahead_steps):
            out = sch.schedule()
            t0 = clock()
            ahead = sch.schedule_ahead(out)
            times["schedule_ahead"].append(clock() - t0)
            if ahead is None:
                raise RuntimeError("schedule_ahead declined a plain decode step")
            retire(out, [w.seq_id for w in out.plan.decodes])  # the blocks it grew stay for the next step
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    print(f"{'batch':>6} {'context':>8} {'schedule':>9} {'prepare':>8} {'finish':>7} {'sync sum':>9} "
          f"{'schedule_ahead':>15}   (us per step, medians of {args.steps})")
    for context in args.context:
        for batch in args.batches:
            m = measure(args.model, batch, context, args.steps)
            total = m["schedule"] + m["prepare"] + m["finish"]
            print(f"{batch:>6} {context:>8} {m['schedule']:>9.0f} {m['prepare']:>8.0f} {m['finish']:>7.0f} "
                  f"{total:>9.0f} {m['schedule_ahead']:>15.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
