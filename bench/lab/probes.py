"""An operator's probes of a live `tandem serve`: the control-plane faults, measured.

    python -m bench.lab.probes choices --url URL [--options 100000]
    python -m bench.lab.probes sigstop --url URL --admin-key KEY [--pause-s 15]
    python -m bench.lab.probes soak --url URL --admin-key KEY [--rate 4] [--duration-s 300]
    python -m bench.lab.probes burst --url URL [--requests 1500]

Each prints one JSON line of figures; none asserts anything (the tests do).

- choices: one request with a structured-output choice list of `--options` short strings
  (about 1 MB at 100,000) while four greedy streams run and /health is polled every
  20 ms: the time to its answer and its status, the longest pause between two chunks of
  the other streams, and the slowest /health.
- sigstop: SIGSTOP to the first decode worker's process for `--pause-s`, then SIGCONT:
  whether the controller replaced it (its pid, epoch and the `replaced` count), and a
  request served after.
- soak: requests at `--rate` per second (Poisson arrivals, streams of 16-128 tokens after
  prompts of 16-256 tokens) for `--duration-s`: latency p50/p99/max, errors, workers
  replaced, and, after the load, the router's own count of running requests per worker
  against each worker's.
- burst: `--requests` at once (non-streaming, 32 tokens each): how many got 200/429/503,
  how long the refusals took to arrive, the Retry-After they said, and how long after
  the poller's first refusal a request of its own was admitted (a separate process asks
  for one token every 0.1 s; its answers' wall times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _admin(url: str, key: str | None) -> dict:
    r = httpx.get(url + "/admin/pools", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)
    r.raise_for_status()
    return r.json()


async def _stream_gaps(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> float:
    """One greedy stream; the longest gap between two of its chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    last, worst = None, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    worst = max(worst, now - last)
                last = now
    return worst


async def choices(url: str, options: int) -> dict:
    spec = {"structured_outputs": {"choice": [f"o{i}" for i in range(options)]}}  # 100,000: about 1 MB
    body = {"prompt": "pick one:", "max_tokens": 16, **spec}
    health: list[float] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def poll():
            while not done.is_set():
                t0 = time.monotonic()
                await client.get("/health")
                health.append(time.monotonic() - t0)
                await asyncio.sleep(0.02)

        streams = [asyncio.create_task(_stream_gaps(client, f"story {i}:", 1500)) for i in range(4)]
        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        answered = time.monotonic() - t0
        gaps = await asyncio.gather(*streams)
        done.set()
        await poller
    return {"probe": "choices", "options": options, "body_bytes": len(json.dumps(body)), "status": r.status_code,
            "answer_s": round(answered, 3), "message": r.text[:200], "longest_stream_pause_s": round(max(gaps), 3),
            "health_max_s": round(max(health), 3), "health_p50_s": _q(health, 0.5)}


async def sigstop(url: str, key: str, pause_s: float) -> dict:
    before = _admin(url, key)
    w = before["pools"]["decode"]["workers"][0]
    os.kill(w["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        await asyncio.sleep(pause_s)
    finally:
        os.kill(w["pid"], signal.SIGCONT)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/completions", json={"prompt": "after the pause", "max_tokens": 8})
    after = _admin(url, key)
    same = [x for x in after["pools"]["decode"]["workers"] if x["worker_id"] == w["worker_id"]]
    return {"probe": "sigstop", "pause_s": pause_s, "worker": w["worker_id"],
            "kept": bool(same) and same[0]["pid"] == w["pid"] and same[0]["epoch"] == w["epoch"],
            "replaced_before": before["replaced"], "replaced_after": after["replaced"],
            "request_after": r.status_code, "seconds": round(time.monotonic() - t0, 1)}


async def soak(url: str, key: str, rate: float, duration_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    words = "the a of river stone light north quiet harbour signal winter paper engine field".split()
    before = _admin(url, key)
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one(client: httpx.AsyncClient) -> None:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(16, 256)))
        body = {"prompt": prompt, "max_tokens": rng.randint(16, 128), "stream": True, "ignore_eos": True}
        t0 = time.monotonic()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                async for _ in r.aiter_lines():
                    pass
        except httpx.HTTPError as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            return
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
            return
        latencies.append(time.monotonic() - t0)

    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        tasks, end = [], time.monotonic() + duration_s
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    await asyncio.sleep(2.0)
    after = _admin(url, key)
    # the router's own count of its requests on each worker, against the workers' own
    leftovers = {w["worker_id"]: {"router_in_flight": w.get("in_flight"), "worker_running": w.get("running")}
                 for pool in after["pools"].values() for w in pool["workers"]}
    return {"probe": "soak", "rate": rate, "duration_s": duration_s, "requests": len(tasks), "ok": len(latencies),
            "errors": errors, "latency_p50_s": _q(latencies, 0.5), "latency_p99_s": _q(latencies, 0.99),
            "latency_max_s": _q(latencies, 1.0), "mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
            "replaced": after["replaced"] - before["replaced"], "after_load": leftovers}


async def burst(url: str, requests: int) -> dict:
    body = {"prompt": "a burst", "max_tokens": 32, "ignore_eos": True}
    refused: list[tuple[float, int, str | None]] = []  # (seconds to the answer, status, Retry-After)
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=requests + 10)) as c:
        async def one():
            t0 = time.monotonic()
            try:
                r = await c.post("/v1/completions", json=body)
            except httpx.HTTPError:
                statuses[-1] = statuses.get(-1, 0) + 1
                return
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code in (429, 503):
                refused.append((time.monotonic() - t0, r.status_code, r.headers.get("retry-after")))

        # a process of its own asks every 0.1 s for one token (this one's loop is busy with
        # the burst's connections): the wall time of its answers shows when there was room
        poller = subprocess.Popen([sys.executable, "-c", _POLLER, url], stdout=subprocess.PIPE, text=True)
        tasks = [asyncio.create_task(one()) for _ in range(requests)]
        await asyncio.gather(*tasks)
        await asyncio.sleep(1.0)
        poller.terminate()
        polls = [line.split() for line in poller.communicate(timeout=30)[0].splitlines()]
        refused_at = [float(t) for t, status in polls if status in ("429", "503")]
        room_s = None
        if refused_at:
            admitted = [float(t) for t, status in polls if status == "200" and float(t) > refused_at[0]]
            room_s = admitted[0] - refused_at[0] if admitted else None
    said = [float(ra) for _, _, ra in refused if ra]
    return {"probe": "burst", "requests": requests, "statuses": statuses,
            "refusal_answer_p50_s": _q([t for t, _, _ in refused], 0.5),
            "refusal_answer_max_s": _q([t for t, _, _ in refused], 1.0),
            "retry_after_min": min(said) if said else None, "retry_after_max": max(said) if said else None,
            "retry_after_p50": _q(said, 0.5), "measured_time_to_room_s": round(room_s, 2) if room_s else None}


_POLLER = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1], timeout=60) as c:
    while True:
        r = c.post("/v1/completions", json={"prompt": "room?", "max_tokens": 1})
        print(f"{time.time():.3f} {r.status_code}", flush=True)
        time.sleep(0.1)
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lab.probes", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("choices", "sigstop", "soak", "burst"))
    p.add_argument("--url", required=True)
    p.add_argument("--admin-key", default=None)
    p.add_argument("--options", type=int, default=100_000)
    p.add_argument("--pause-s", type=float, default=15.0)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    url = a.url.rstrip("/")
    if a.probe == "choices":
        out = asyncio.run(choices(url, a.options))
    elif a.probe == "sigstop":
        out = asyncio.run(sigstop(url, a.admin_key, a.pause_s))
    elif a.probe == "soak":
        out = asyncio.run(soak(url, a.admin_key, a.rate, a.duration_s, a.seed))
    else:
        out = asyncio.run(burst(url, a.requests))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
