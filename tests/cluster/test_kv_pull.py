"""Prefixes pulled from a peer through HTTP: two prefill workers and a decode worker.
The prefill worker that computed a prompt is drained; the next turn goes to the other,
which pulls the prefix from the first instead of computing it. And the same with the
holder killed while it writes: the pull fails, the prompt is computed, the answer is
transformers' own, and the puller's reserved blocks come back after their quarantine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from tests.cluster.test_kv_tiers_serving import settled
from tests.cluster.test_serve import TOKEN, labelled
from tests.cluster.test_tp_serving import complete
from tests.oracle import hf_greedy, random_prompts
from worker_runtime.rpc import call_metadata

pytestmark = pytest.mark.cluster

N = 8
FLAGS = ("--prefill", "2", "--decode", "1", "--transport", "tcp", "--local-prefill-threshold", "0",
         "--block-size", "16", "--num-blocks", "128", "--reservation-quarantine-s", "6", "--transfer-timeout-s", "4")


def prefill_workers(srv) -> dict[str, dict]:
    return {w["worker_id"]: w for w in srv.pools()["prefill"]["workers"]}


def series(w: dict, name: str) -> dict[tuple, float]:
    return labelled(httpx.get(f"http://{w['metrics']}/metrics", timeout=10).text, name)


def holder_of(srv) -> str:
    """The prefill worker the router sent the only prompt so far to."""
    routed = labelled(httpx.get(srv.url + "/metrics", timeout=10).text, "tandem:routed_requests_total")
    [wid] = [dict(k)["worker_id"] for k, v in routed.items() if dict(k)["role"] == "prefill" and v > 0]
    return wid


def drain(srv, w: dict) -> None:
    async def go():
        async with grpc.aio.insecure_channel(w["address"]) as ch:
            await pb_grpc.PrefillWorkerStub(ch).Drain(pb.DrainRequest(drain=True), timeout=10,
                                                      metadata=call_metadata(TOKEN))
    asyncio.run(go())
    time.sleep(1.0)  # the router reads the worker's stats every 0.25 s


def test_a_prefill_worker_pulls_a_prefix_another_one_holds(serve, model_path):
    srv = serve(*FLAGS)
    model = str(model_path)
    first, suffix = random_prompts([200, 40], seed=51)
    assert complete(srv.url, model, first, N)["choices"][0]["token_ids"] == hf_greedy(model_path, first, N,
                                                                                      ignore_eos=True)
    workers = prefill_workers(srv)
    holder = holder_of(srv)
    [other] = [wid for wid in workers if wid != holder]
    drain(srv, workers[holder])
    second = first + suffix
    got = complete(srv.url, model, second, N)
    assert got["choices"][0]["token_ids"] == hf_greedy(model_path, second, N, ignore_eos=True)
    pulled = sum(series(workers[other], "tandem:kv_pull_blocks_total").values())
    pushed = sum(series(workers[holder], "tandem:kv_push_blocks_total").values())
    # the whole blocks of the first prompt, bar the last (the decode worker holds them too: a
    # prefill worker is asked first)
    assert pulled == pushed >= 200 // 16 - 1, (pulled, pushed)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= pulled * 16
    assert srv.metrics()["tandem:router_pull_hints_total"] >= 1
    # nothing held (tandem status reads the stats the controller polled last: a moment behind)
    settled(srv, lambda ps: all(w["kv_usage"] == 0 for p in ps.values() for w in p["workers"]))
    for w in prefill_workers(srv).values():
        assert w["kv_usage"] == 0, w


def test_a_holder_that_dies_mid_pull_leaves_the_prompt_computed(serve, model_path, monkeypatch):
    # every KV write waits 1.5 s: the holder is killed while its push waits
    monkeypatch.setenv("TANDEM_FAULTS", "transfer_delay_s=1.5")
    srv = serve(*FLAGS)
    model = str(model_path)
    first, suffix = random_prompts([200, 40], seed=52)
    complete(srv.url, model, first, N)
    workers = prefill_workers(srv)
    holder = holder_of(srv)
    [other] = [wid for wid in workers if wid != holder]
    drain(srv, workers[holder])
    second = first + suffix

    async def ask():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            body = {"model": model_path.name, "prompt": second, "max_tokens": N, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            for _ in range(400):  # the pull has started once the holder's push holds its blocks
                await asyncio.sleep(0.01)
                if sum(series(workers[holder], "tandem:kv_handoffs_in_flight").values()):
                    break
            else:
                raise AssertionError("the holder never started its push")
            os.kill(workers[holder]["pid"], signal.SIGKILL)
            return await task

    r = asyncio.run(ask())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(model_path, second, N, ignore_eos=True)
    failed = series(workers[other], "tandem:kv_pulls_total")
    assert failed[(("outcome", "failed"), ("role", "prefill"), ("worker_id", other))] == 1
    # the reservation for the pull is quarantined for 6 s, then freed: nothing stays held
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        w = prefill_workers(srv).get(other)
        if w is not None and w["kv_usage"] == 0:
            break
        time.sleep(0.5)
    assert prefill_workers(srv)[other]["kv_usage"] == 0
