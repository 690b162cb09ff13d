"""What a structured-output mask costs a decode step: the engine's step time at batch
1, 16 and 64 with every sequence under a JSON-schema grammar, and with none.

    python -m bench.lab.structured [--batches 1,16,64] [--steps 40] [--threads N] [--model DIR]
                               [--json PATH|-]

The LLMEngine is stepped directly (no HTTP). B requests with random 32-token prompts
are prefilled, then --steps decode steps are timed (wall clock of `step()`), taking
turns with and without the grammar, --rounds times; the median step is reported, and
apart from it the mask's own share (llguidance filling B bitmasks in parallel, and the
torch op applying them), measured around the sampler's two calls. The schema keeps
every sequence inside an unbounded string field, the state where the most tokens are
allowed: both runs carry a logit_bias of -100 on every token that holds a double quote,
so the string never closes (both pay for the bias alike). Steps where a sequence had
finished anyway are not counted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from bench.lab.sweep import machine_info

SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 1}}, "required": ["notes"],
          "additionalProperties": False}


def _quote_tokens(engine) -> list[int]:
    from engine.tokenizer import Tokenizer

    if not hasattr(engine, "_quote_ids"):
        tok = Tokenizer.from_dir(engine.checkpoint.path)
        engine._quote_ids = [i for i in range(tok.vocab_size) if '"' in tok.decode([i], skip_special_tokens=False)]
    return engine._quote_ids[:300]


def _run(engine, batch: int, steps: int, guided: bool, tag: str) -> tuple[list[float], list[float]]:
    from engine import sampler as sampler_mod
    from engine.sampling_params import GuidedSpec, SamplingParams
    spec = GuidedSpec.json_schema(SCHEMA) if guided else None
    params = SamplingParams(max_tokens=steps + 8, temperature=1.0, ignore_eos=True, seed=1, guided=spec,
                            logit_bias=tuple((t, -100.0) for t in _quote_tokens(engine)))
    rng = random.Random(7)
    for i in range(batch):
        prompt = [rng.randrange(5, 8000) for _ in range(32)]
        engine.add_request(f"{tag}-{i}", prompt, params.replace(seed=i))
    while any(len(s.output_ids) < 2 for s in engine.seqs.values()):  # prefills and the first decode
        engine.step()
    mask_s: list[float] = []
    fill, apply = sampler_mod.fill_bitmask, sampler_mod.apply_bitmask

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                mask_s[-1] += time.perf_counter() - t
        return wrapper

    sampler_mod.fill_bitmask, sampler_mod.apply_bitmask = timed(fill), timed(apply)
    times: list[float] = []
    try:
        for _ in range(steps):
            running = len(engine.scheduler.running)
            mask_s.append(0.0)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if running == batch and len(engine.scheduler.running) == batch:
                times.append(dt)
            else:
                mask_s.pop()
    finally:
        sampler_mod.fill_bitmask, sampler_mod.apply_bitmask = fill, apply
    for sid in list(engine.seqs):
        engine.abort(sid)
    engine.check_integrity()
    return times, mask_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None, help="write the results here (- for stdout)")
    args = ap.parse_args(argv)

    from decode_worker.llm_engine import LLMEngine
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig

    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, cache=CacheConfig(num_blocks=max(batches) * 8 + 64),
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(512, max(batches) * 32),
                                  max_model_len=512),
        device=DeviceConfig(num_threads=args.threads)))
    rows = []
    for b in batches:
        plain: list[float] = []
        masked: list[float] = []
        mask: list[float] = []
        for r in range(args.rounds):  # alternate, so drift on a shared machine hits both alike
            plain += _run(engine, b, args.steps, False, f"p{b}-{r}")[0]
            t, m = _run(engine, b, args.steps, True, f"g{b}-{r}")
            masked += t
            mask += m
        p50, g50, m50 = (statistics.median(x) * 1e3 for x in (plain, masked, mask))
        rows.append({"batch": b, "step_ms_plain": round(p50, 3), "step_ms_json_schema": round(g50, 3),
                     "mask_ms": round(m50, 3), "overhead_pct": round(100 * (g50 / p50 - 1), 1),
                     "steps_counted": [len(plain), len(masked)]})
        print(f"batch {b:3d}: step {p50:7.2f} ms plain, {g50:7.2f} ms with a JSON-schema mask "
              f"({rows[-1]['overhead_pct']:+.1f}%); the mask itself {m50:.3f} ms a step", flush=True)
    out = {"bench": "structured", "machine": machine_info(), "threads": args.threads, "schema": SCHEMA, "rows": rows}
    if args.json == "-":
        json.dump(out, sys.stdout, indent=2)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
