"""KV tiers through HTTP: a served cluster whose workers' device caches hold a quarter
of the working set. Prefixes come back from host memory and from disk, a damaged disk
file under the live server is a miss, preempted requests swap out and back in; every
answer is transformers' greedy one, and no block is left held."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.test_serve import labelled
from tests.cluster.test_tp_serving import complete
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.cluster

N = 8
# the built-in model: 64 KiB a block of 16 tokens; the device cache 24 blocks, the working set ~50
TIERS = ("--block-size", "16", "--num-blocks", "24", "--kv-offload-host-gb", str(8 * 64 / 2**20),
         "--kv-offload-disk-gb", str(128 * 64 / 2**20), "--swap-space", str(16 * 64 / 2**20))
PROMPTS = random_prompts([100, 120, 90, 110, 100, 97, 130, 85], seed=41)


def worker_series(srv, role: str, name: str) -> dict[tuple, float]:
    [w] = srv.pools()[role]["workers"]
    return labelled(httpx.get(f"http://{w['metrics']}/metrics", timeout=10).text, name)


def hits_of(srv, role: str) -> dict[str, float]:
    return {dict(k)["tier"]: v for k, v in worker_series(srv, role, "tandem:kv_offload_hits_total").items()}


def settled(srv, check, timeout_s: float = 15.0) -> dict:
    """The pools as `tandem status` shows them once `check(pools)` holds: it reads the stats
    the controller polled last, a moment behind the workers (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = srv.pools()
        if check(pools) or time.monotonic() > deadline:
            return pools
        time.sleep(0.2)


def all_blocks_free(srv) -> None:
    pools = settled(srv, lambda ps: all(w["kv_usage"] == 0 for p in ps.values() for w in p["workers"]))
    for pool in pools.values():
        for w in pool["workers"]:
            assert w["kv_usage"] == 0, f"{w['worker_id']} holds blocks: {w}"


def test_tiers_on_a_disaggregated_cluster(serve, model_path, tmp_path):
    """The prefill worker's prefix cache continues in host memory and on disk: a prompt
    sent again after the others pushed it out of the device prefills from its restored
    blocks, and the KV the decode worker receives gives transformers' tokens."""
    srv = serve("--prefill", "1", "--decode", "1", "--transport", "tcp", "--local-prefill-threshold", "0",
                "--kv-offload-disk-path", str(tmp_path / "kv"), *TIERS)
    model = str(model_path)
    ref = [hf_greedy(model_path, p, N, ignore_eos=True) for p in PROMPTS]
    for _ in range(2):  # the second round finds every prompt below the prefill worker's device
        for p, want in zip(PROMPTS, ref):
            assert complete(srv.url, model, p, N)["choices"][0]["token_ids"] == want
    hits = hits_of(srv, "prefill")
    assert hits["disk"] > 0, hits  # (host memory holds 8 blocks: most came up from disk first)
    [p] = settled(srv, lambda ps: ps["prefill"]["workers"][0].get("tiers", {}).get("hits"))["prefill"]["workers"]
    assert 0 < p["tiers"]["hits"] <= hits["host"] + hits["disk"] and p["tiers"]["disk_used"] > 0
    assert list((tmp_path / "kv" / p["worker_id"] / "r0").glob("*.kv"))  # the worker's own directory
    all_blocks_free(srv)


def test_tiers_colocated_with_a_damaged_disk_and_swapped_preemptions(serve, model_path, tmp_path):
    srv = serve("--colocated", "--decode", "1", "--kv-offload-disk-path", str(tmp_path / "kv"),
                "--max-num-batched-tokens", "128", *TIERS)
    model = str(model_path)
    ref = [hf_greedy(model_path, p, N, ignore_eos=True) for p in PROMPTS]
    for p, want in zip([*PROMPTS, *PROMPTS], [*ref, *ref]):
        assert complete(srv.url, model, p, N)["choices"][0]["token_ids"] == want
    hits = hits_of(srv, "decode")
    assert hits["disk"] > 0, hits

    # damage every file the worker wrote, under the live server: misses, and the same tokens
    [w] = srv.pools()["decode"]["workers"]
    files = sorted(Path(tmp_path / "kv" / w["worker_id"] / "r0").glob("*.kv"))
    assert files
    for i, f in enumerate(files):
        raw = f.read_bytes()
        f.write_bytes(raw[: len(raw) // 2] if i % 2 else raw[:-9] + bytes([raw[-9] ^ 1]) + raw[-8:])
    for p, want in zip(PROMPTS, ref):
        assert complete(srv.url, model, p, N)["choices"][0]["token_ids"] == want
    errors = worker_series(srv, "decode", "tandem:kv_offload_disk_errors_total")
    assert sum(errors.values()) > 0

    # four long answers at once need 36 blocks of the 24: preemptions, swapped to host memory
    long = random_prompts([60, 70, 50, 65], seed=42)
    n = 60
    want = [hf_greedy(model_path, p, n, ignore_eos=True) for p in long]

    async def together():
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
            body = {"model": model_path.name, "prompt": long, "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return sorted(r.json()["choices"], key=lambda c: c["index"])

    got = asyncio.run(together())
    assert [c["token_ids"] for c in got] == want
    decisions = {dict(k)["decision"]: v for k, v in
                 worker_series(srv, "decode", "tandem:kv_preemptions_by_decision_total").items()}
    assert decisions["swap"] > 0, decisions
    all_blocks_free(srv)
