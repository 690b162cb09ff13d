"""Multi-turn chat against `tandem serve`, one server per decode-routing policy (or per
variant of the server's options), in one run.

    python -m bench.lab.multiturn [--model DIR] [--policies headroom,prefix]
                              [--conversations 8] [--turns 6] [--max-tokens 32]
                              [--serve-args "--colocated --decode 2"] [--json PATH]
                              [--variants "off=;host=--kv-offload-host-gb 2"] [--shared-system]

`--variants`: NAME=OPTIONS pairs, separated by ";": a server each, with OPTIONS added to
--serve-args and the first policy (e.g. KV tiers off and on). `--shared-system`: every
conversation opens with the same system prompt (an agent's long instructions and tool
list), as against a system prompt of each conversation's own.

Each conversation is a closed loop, as a chat client is: a system prompt of its own,
then turns; every turn resends the whole conversation so far (the system prompt, each
user message and the model's own earlier answers) as one /v1/completions prompt,
streamed, and waits for the answer before the next turn. Conversations run
concurrently. Per policy the report gives the share of prompt tokens served from the
prefix cache (usage `cached_tokens`), TTFT p50/p99, output tokens per second, and the
router's `tandem:decode_decisions_total` by reason. Throughput and latency are
reported separately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import shlex
import sys
import time

import httpx
import numpy as np

from bench.servers import TandemServer

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be "
         "had not but have one they their you all we can more if some there two into time only new "
         "would other when what so out up about then them these may first any like could no my than "
         "been who its over such way even most after also did many before must through back years "
         "where much your well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _turn(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ok": True, "ttft": ttft, "text": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": usage["completion_tokens"]}


async def _conversation(client, seed: int, turns: int, max_tokens: int, system_words: int, user_words: int,
                        out: list, shared_system: bool = False, think_s: float = 0.0) -> None:
    rng = random.Random(seed)
    history = f"System: {_words(random.Random(0) if shared_system else rng, system_words)}\n"
    for turn in range(turns):
        if think_s and turn:  # the user reads the answer and types the next message
            await asyncio.sleep(rng.expovariate(1 / think_s))
        history += f"User: {_words(rng, user_words)}\nAssistant:"
        r = await _turn(client, history, max_tokens)
        r["conversation"] = seed
        out.append(r)
        if not r["ok"]:
            return
        history += r["text"] + "\n"


def _decisions(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "tandem:decode_decisions_total"}


def _tier_hits(server, admin_key: str) -> dict[str, float]:
    """Blocks restored from below the device, by tier, and preemptions by decision, summed
    over the workers (their own /metrics, listed by the admin API)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        pools = httpx.get(server.url + "/admin/pools", timeout=10,
                          headers={"Authorization": f"Bearer {admin_key}"}).json()["pools"]
    except Exception:  # noqa: BLE001 - an admin API behind a key: no tier figures
        return out
    for pool in pools.values():
        for w in pool["workers"]:
            text = httpx.get(f"http://{w['metrics']}/metrics", timeout=10).text
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    key = {"tandem:kv_offload_hits_total": "hits_" + s.labels.get("tier", ""),
                           "tandem:kv_preemptions_by_decision_total": "preempt_" + s.labels.get("decision", ""),
                           "tandem:kv_offload_queries_total": "tier_queries",
                           "tandem:kv_pull_blocks_total": "pulled_blocks",
                           "tandem:kv_offload_disk_errors_total": "disk_errors",
                           "tandem:num_preemptions_total": "preemptions"}.get(s.name)
                    if key:
                        out[key] = out.get(key, 0.0) + s.value
    return out


def run_policy(policy: str, a: argparse.Namespace, variant: tuple[str, str] | None = None) -> dict:
    serve_args = [*shlex.split(a.serve_args), *shlex.split(variant[1] if variant else ""), "--decode-routing", policy]
    if a.model:
        serve_args += ["--model", a.model]
    name = variant[0] if variant else policy
    admin_key = secrets.token_hex(8)  # the workers' /metrics addresses come from the admin API
    serve_args += ["--admin-key", admin_key]
    server = TandemServer.launch(serve_args, f"{a.log_prefix}-{name.replace('+', '-')}.log")
    try:
        async def go() -> tuple[list, float]:
            out: list = []
            limits = httpx.Limits(max_connections=a.conversations + 4)
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
                t0 = time.perf_counter()
                await asyncio.gather(*(_conversation(client, 1000 + i, a.turns, a.max_tokens, a.system_words,
                                                     a.user_words, out, a.shared_system, a.think_s)
                                       for i in range(a.conversations)))
                return out, time.perf_counter() - t0

        results, wall = asyncio.run(go())
        decisions = _decisions(server.url)
        tiers = _tier_hits(server, admin_key)
    finally:
        server.stop()
    ok = [r for r in results if r["ok"]]
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "policy": name, "serve_args": serve_args, "tier_hits": tiers,
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "cached_share": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "output_tok_s": sum(r["completion_tokens"] for r in ok) / wall, "decode_decisions": decisions,
        "turns": [{k: r.get(k) for k in ("conversation", "prompt_tokens", "cached_tokens", "ttft")} for r in ok],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--policies", default="headroom,prefix", help="decode-routing policies, in order")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--serve-args", default="--colocated --decode 2", help="more `tandem serve` options, quoted")
    p.add_argument("--log-prefix", default="/tmp/tandem-multiturn", help="server logs: PREFIX-POLICY.log")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--variants", default=None, metavar="NAME=OPTIONS;...",
                   help="a server per variant, OPTIONS added to --serve-args (with the first policy)")
    p.add_argument("--shared-system", action="store_true", help="one system prompt for every conversation")
    p.add_argument("--think-s", type=float, default=0.0, metavar="S",
                   help="a user's pause between an answer and the next turn, exponential with this mean (0: none); "
                   "with pauses most conversations are idle at any time, their context held only by the cache")
    a = p.parse_args(argv)
    if a.variants:
        policy = a.policies.split(",")[0]
        variants = [tuple(v.split("=", 1)) for v in a.variants.split(";") if v.strip()]
        rows = [run_policy(policy, a, (n.strip(), opts)) for n, opts in variants]
    else:
        rows = [run_policy(policy, a) for policy in a.policies.split(",")]
    print(f"multi-turn chat: {a.conversations} conversations x {a.turns} turns, {a.max_tokens} tokens an answer, "
          f"{'one shared' if a.shared_system else 'its own'} system prompt of {a.system_words} words, "
          f"{a.user_words} words a user turn, think time {a.think_s:g} s, "
          f"`tandem serve {a.serve_args}`")
    print(f"| {'variant' if a.variants else 'decode routing'} | requests (failed) | prompt tokens from cache "
          "| TTFT p50 ms | TTFT p99 ms | output tok/s | decisions | tier hits (blocks), preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dec = ", ".join(f"{k} {v:g}" for k, v in sorted(r["decode_decisions"].items()) if v)
        tiers = ", ".join(f"{k} {v:g}" for k, v in sorted(r["tier_hits"].items()) if v)
        print(f"| {r['policy']} | {r['requests']} ({r['failed']}) | {r['cached_share']:.1%} "
              f"({r['cached_tokens']} of {r['prompt_tokens']}) | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
              f"| {r['output_tok_s']:.1f} | {dec} | {tiers} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": rows}, f, indent=2)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
