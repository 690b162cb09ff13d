"""The offline engine alone and beside a neighbour that behaves like a router and its
client: what other processes' CPU time costs a batch of steps on shared cores.

    python -m bench.lab.interference [--model DIR] [--prompts 200] [--prompt-len 256]
        [--output-len 128] [--threads 2] [--period-ms 118] [--exchanges 200] [--work-us 50]

The neighbour is two processes that, once every `--period-ms`, make `--exchanges`
round trips over a socket pair, each side spending `--work-us` (the reader 60% of it)
on the CPU between messages: about what tandem's router and `vllm bench serve` cost a
decode step of 200 streams on the 2-core development machine (docs/performance.md,
thirteenth round). It has no affinity, like a router and a client on the same host.

Each run prints output tokens/s and the time in steps that carried prompt tokens and
in decode-only steps, so a change meant to make steps tolerate their neighbours (thread
teams, wait policies) can be measured offline, without a server's run-to-run spread.
Speed is printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import time
from typing import Any


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def neighbour(period_s: float, exchanges: int, work_s: float, stop, max_s: float) -> None:
    """The router-and-client stand-in (runs in a process of its own until `stop` is set,
    or `max_s` has passed)."""
    a, b = socket.socketpair()
    child = os.fork()
    if child == 0:  # the "client": answers each message after its share of the work
        a.close()
        try:
            while True:
                if not b.recv(64):
                    break
                _spin(work_s * 0.6)
                b.sendall(b"k")
        finally:
            os._exit(0)
    b.close()
    deadline = time.monotonic() + max_s
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            t0 = time.perf_counter()
            for _ in range(exchanges):
                _spin(work_s)
                a.sendall(b"x")
                a.recv(64)
            rest = period_s - (time.perf_counter() - t0)
            if rest > 0:
                stop.wait(rest)
    finally:
        a.close()  # the child sees EOF and exits
        os.waitpid(child, 0)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """One timed generate() of the offline engine; returns tokens/s and step times (each
    step's own forward time, from the engine's `on_forward` hook)."""
    from decode_worker.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(args.prompts, 1),
              max_model_len=args.prompt_len + args.output_len + 16, enable_prefix_caching=False)
    engine = llm.engine
    spent = {"prompt": [0.0, 0], "decode": [0.0, 0]}

    def on_forward(num_tokens: int, forward_s: float, decode_only: bool) -> None:
        e = spent["decode" if decode_only else "prompt"]
        e[0] += forward_s
        e[1] += 1

    vocab = engine.runner.model.cfg.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    engine.on_forward = on_forward
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "prompt_steps": spent["prompt"][1],
        "prompt_steps_s": round(spent["prompt"][0], 3),
        "decode_steps": spent["decode"][1],
        "decode_step_ms": round(1e3 * spent["decode"][0] / max(spent["decode"][1], 1), 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.lab.interference", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--period-ms", type=float, default=118.0)
    p.add_argument("--exchanges", type=int, default=200)
    p.add_argument("--work-us", type=float, default=50.0)
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    if args.model is None:
        from engine.models.builtin import builtin_model_path

        args.model = str(builtin_model_path())

    alone = run_engine(args)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no torch threads in the neighbour
    stop = ctx.Event()
    proc = ctx.Process(target=neighbour, daemon=True,
                       args=(args.period_ms / 1e3, args.exchanges, args.work_us / 1e6, stop,
                             max(60.0, 4 * alone["wall_s"] + 30)))
    proc.start()
    try:
        beside = run_engine(args)
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "alone": alone, "beside": beside}
    for name in ("alone", "beside"):
        r = doc[name]
        print(f"{name:>7}: {r['output_tok_s']:9.1f} out tok/s  prompt steps {r['prompt_steps']:4d} "
              f"{r['prompt_steps_s']:7.2f} s  decode-only steps {r['decode_steps']:4d} "
              f"at {r['decode_step_ms']:7.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
