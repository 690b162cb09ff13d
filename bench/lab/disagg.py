"""`python -m bench.lab.disagg`: what disaggregation costs, in one run.

1. KV transfer bandwidth: GB/s for 1, 64 and 1024 blocks per request over NIXL and TCP,
   against an in-process copy of the same scattered bytes (bench/lab/transfer.py).
2. TTFT split of one disaggregated request (a prefill worker and a decode worker, each
   its own process pinned to its own core, no other load), per transport and with
   layer-wise push on and off:
     reserve   router -> decode worker: blocks reserved, reservation back
     queue     waiting on the prefill worker
     prefill   first chunk scheduled -> last layer computed
     transfer  last write issued -> written and notified (what layer-wise push overlaps)
     rpc       the rest of the prefill call (gRPC, handshake-free steady state)
     TTFT      request sent -> first token at the router
     decode1   first token at the router -> second token (landing + first decode step)
   next to the TTFT of the same prompt prefilled locally on the decode worker.
Medians over `--reps` fresh prompts (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb
from router.backend import GenerateRequest
from router.worker_client import _decode_request, local_stream, run_prefill, wait_ready
from worker_runtime.process import spawn_worker


def _prompt(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(5, 8000) for _ in range(n)]


async def _one_remote(pc, dc, rid: str, prompt: list[int]) -> dict:
    req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    call = dc.stub.Decode(_decode_request(req, pb.REMOTE_PREFILL, 30.0), metadata=dc.metadata)
    first = await call.read()
    t_res = time.perf_counter()
    outcome = await run_prefill(pc, dc, req, first.reservation, timeout=60)
    t_first = time.perf_counter()
    if outcome.reply is None:
        raise RuntimeError(outcome.error)
    t_second = None
    while True:
        ev = await call.read()
        if ev.WhichOneof("kind") == "tokens" and any(
            i >= 1 for i in range(ev.tokens.first_index, ev.tokens.first_index + len(ev.tokens.token_ids))
        ):
            t_second = time.perf_counter()
        if ev.tokens.finished:
            break
    t = outcome.reply.timings
    prefill_call = t_first - t_res
    return {
        "ttft": t_first - t0,
        "reserve": t_res - t0,
        "queue": t.queue_s,
        "prefill": t.prefill_s,
        "transfer": t.transfer_s,
        "rpc": prefill_call - t.queue_s - t.prefill_s - t.transfer_s,
        "decode1": (t_second or t_first) - t_first,
    }


async def _one_local(dc, rid: str, prompt: list[int]) -> float:
    req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    async for batch in local_stream(dc, req):
        if batch.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def _ttft_case(transport: str, layerwise: bool, lengths: list[int], reps: int, log_dir: str) -> list[dict]:
    p_args = ["--cpu-affinity", "1", "--max-num-batched-tokens", "4096", "--max-model-len", "4096"]
    d_args = ["--cpu-affinity", "0", "--max-model-len", "4096"]
    if not layerwise:
        p_args.append("--no-layerwise-transfer")
    d = spawn_worker("decode", "decode-b", log_dir, transport=transport, args=tuple(d_args), num_blocks=1024)
    p = spawn_worker("prefill", "prefill-b", log_dir, transport=transport, args=tuple(p_args), num_blocks=1024)
    rows = []
    try:
        dc, pc = d.client(), p.client()
        await wait_ready(dc)
        await wait_ready(pc)
        await _one_remote(pc, dc, "warm", _prompt(64, 999))  # handshake, first-touch allocations
        await _one_local(dc, "warm-l", _prompt(64, 998))
        for n in lengths:
            runs = [await _one_remote(pc, dc, f"r{n}-{i}", _prompt(n, 1000 * n + i)) for i in range(reps)]
            local = [await _one_local(dc, f"l{n}-{i}", _prompt(n, 7000 * n + i)) for i in range(reps)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append(
                {
                    "transport": transport,
                    "layerwise": layerwise,
                    "prompt": n,
                    **row,
                    "local_ttft": statistics.median(local),
                }
            )
        await dc.close()
        await pc.close()
    finally:
        p.stop()
        d.stop()
    return rows


def _print_ttft(rows: list[dict]) -> None:
    cols = ("reserve", "queue", "prefill", "transfer", "rpc", "ttft", "decode1", "local_ttft")
    print("\nTTFT split, ms (median)")
    print(f"{'transport':9} {'layerwise':9} {'prompt':>6} " + " ".join(f"{c:>10}" for c in cols))
    for r in rows:
        print(
            f"{r['transport']:9} {str(r['layerwise']):9} {r['prompt']:>6} "
            + " ".join(f"{r[c] * 1000:10.2f}" for c in cols)
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.lab.disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--lengths", default="128,512,2048", help="prompt lengths (tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    a = ap.parse_args(argv)
    transports = a.transports.split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.quick:
        lengths, a.reps = [64], 1
    if not a.skip_bandwidth:
        from bench.lab import transfer

        print("KV transfer bandwidth (bench/lab/transfer.py)")
        transfer.main(
            [
                "--transports",
                ",".join(transports),
                "--blocks",
                "1,64" if a.quick else "1,64,1024",
                "--configs",
                "tiny" if a.quick else "tiny,large",
            ]
        )
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for transport in transports:
            for layerwise in (True, False):
                rows += asyncio.run(_ttft_case(transport, layerwise, lengths, a.reps, log_dir))
    _print_ttft(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
