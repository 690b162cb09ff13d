"""Tensor-parallel workers across processes: prefill and decode workers whose ranks hold
different KV heads hand prompts off exactly (every pairing of 1 and 2 ranks, KV heads
split and replicated, Llama and Qwen2), through chunked prefills and prefix hits, with
n-gram speculation on a 2-rank decode worker; and through HTTP under `tandem serve`,
where each worker's ranks are Ray actors in one placement group: colocated with
preemptions, a prefix hit and a rank killed mid-stream, and disaggregated in the three
pairings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb
from router.backend import GenerateRequest
from router.worker_client import disaggregated_stream, local_stream
from tests.cluster.test_disagg import assert_clean
from tests.cluster.test_serve import worker_settles_clean
from tests.cluster.test_transport import _nixl_works
from tests.model.conftest import _write_hf
from tests.oracle import hf_greedy, random_prompts
from worker_runtime.client import wait_ready
from worker_runtime.config import WORKER_LOST

pytestmark = pytest.mark.cluster

NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path):
    """Random Llama (2 KV heads: split by 2 ranks; 1 KV head: held by both) and Qwen2
    (q/k/v biases), the built-in tokenizer; and the trained built-in model."""
    root = tmp_path_factory.mktemp("tp-ckpts")
    return {"llama-kv2": _write_hf("llama", root / "llama-kv2", model_path),
            "llama-kv1": _write_hf("llama", root / "llama-kv1", model_path, kv_heads=1),
            "qwen2": _write_hf("qwen2", root / "qwen2", model_path),
            "qwen3_moe": _write_hf("qwen3_moe", root / "qwen3_moe", model_path),
            "mixtral": _write_hf("mixtral", root / "mixtral", model_path),
            "gemma2": _write_hf("gemma2", root / "gemma2", model_path),
            "phi3": _write_hf("phi3", root / "phi3", model_path),
            "builtin": model_path}


def handoff_prompts():
    """Lengths around the 16-token blocks, a 160-token prompt (three 64-token chunks),
    and two that share its first 64 tokens (prefix hits on both workers)."""
    ps = random_prompts([1, 5, 16, 17, 33, 160], seed=22)
    return ps + [ps[-1][:64] + tail for tail in random_prompts([3, 20], seed=23)]


@pytest.mark.parametrize("name,p_tp,d_tp,spec,transport", [
    ("llama-kv2", 2, 1, None, "tcp"), ("llama-kv2", 1, 2, None, "tcp"), ("llama-kv2", 2, 2, None, "tcp"),
    ("llama-kv1", 2, 1, None, "tcp"), ("llama-kv1", 1, 2, None, "tcp"), ("llama-kv1", 2, 2, None, "tcp"),
    # Qwen2 differs from Llama in its q/k/v biases (split with their rows), not in the KV
    # heads' layout the pairings above cover: one pairing, both sides split
    ("qwen2", 2, 2, None, "tcp"),
    ("builtin", 1, 2, "ngram", "tcp"),
    ("llama-kv2", 2, 2, None, "nixl"),  # ranks holding the same heads: whole blocks, rank to rank
])
async def test_prefill_and_decode_ranks_of_any_pairing_hand_off_exactly(spawn, checkpoints, name, p_tp, d_tp,
                                                                          spec, transport):
    if transport == "nixl" and (why := _nixl_works()):
        pytest.skip(why)
    model = str(checkpoints[name])
    common = ("--model", model, "--block-size", "16")
    d_args = (*common, "--tensor-parallel-size", str(d_tp))
    if spec:
        d_args += ("--speculative-method", spec, "--no-adaptive-speculation")
    d, p = spawn.together(("decode", "decode-0", {"transport": transport, "args": d_args}),
                          ("prefill", "prefill-0", {"transport": transport, "args": (
                              *common, "--tensor-parallel-size", str(p_tp), "--max-num-batched-tokens", "64")}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    prompts = handoff_prompts()
    reqs = [GenerateRequest(f"r{i}", pr, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
            for i, pr in enumerate(prompts)]
    outs = await asyncio.gather(*(with_usage(disaggregated_stream(pc, dc, r, fallback_local=False)) for r in reqs))
    for i, (pr, (out, _)) in enumerate(zip(prompts, outs)):
        assert out == hf_greedy(model, pr, NEW, ignore_eos=True), f"request {i}"
    assert (await pc.stats()).prefix_cache_hits > 0
    if spec:  # the trained model repeats itself: drafts verified on both decode ranks, and kept
        assert sum(last.accepted_tokens for _, last in outs) > 0
    # a prefix only the decode worker holds (it prefilled it itself): the prefill worker pulls
    # it (worker_runtime/kv_pull.py), each decode rank writing the heads each prefill rank holds
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    own, tail = random_prompts([80, 10], seed=24)
    out, _ = await with_usage(local_stream(dc, GenerateRequest("own", own, params)))
    assert out == hf_greedy(model, own, NEW, ignore_eos=True)
    source = pb.PullSource(worker_id="decode-0", address=dc.address, role="decode", num_blocks=len(own) // 16)
    seen = []
    out, _ = await with_usage(disaggregated_stream(pc, dc, GenerateRequest("pulled", own + tail, params),
                                                   fallback_local=False, on_prefill=seen.append, pull=source))
    assert out == hf_greedy(model, own + tail, NEW, ignore_eos=True)
    assert seen[0].reply.num_cached_tokens == 80  # its 5 blocks came from the decode worker
    await assert_clean(dc, pc)



def rank_children(worker) -> list[psutil.Process]:
    """The live rank processes (`python -m engine.parallel.rank`) of a worker run on its own."""
    out = []
    for c in psutil.Process(worker.proc.pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "engine.parallel.rank" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:  # gone, or killed and not yet reaped
            pass
    return out


async def test_a_rank_killed_on_either_side(spawn, checkpoints):
    """A prefill rank killed mid-prefill: the prefill fails with the reason, the prompt is
    prefilled on the decode worker instead and its tokens are exact, the decode side holds
    no block, and the prefill worker reports itself unhealthy (its controller would
    replace it). Then a decode rank killed mid-stream: the stream ends with the
    worker-lost error (a router moves such requests, test above), and the decode worker
    reports itself unhealthy. SIGTERM then stops both at once."""
    model = str(checkpoints["llama-kv2"])
    common = ("--model", model, "--block-size", "16", "--tensor-parallel-size", "2")
    d, p = spawn.together(("decode", "decode-0", {"args": (*common, "--reservation-quarantine-s", "1")}),
                          ("prefill", "prefill-0", {"faults": "prefill_step_delay_s=0.2",
                                                    "args": (*common, "--max-num-batched-tokens", "32")}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    [prompt] = random_prompts([320], seed=64)  # 10 chunks of 32 at 0.2 s each
    req = GenerateRequest("long", prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    task = asyncio.create_task(with_usage(disaggregated_stream(pc, dc, req, fallback_local=True)))
    deadline = time.monotonic() + 30
    while (await pc.stats()).num_running != 1:
        assert time.monotonic() < deadline, "the prefill never started"
        await asyncio.sleep(0.02)
    [rank] = rank_children(p)
    rank.kill()
    out, _ = await asyncio.wait_for(task, 60)
    assert out == hf_greedy(model, prompt, NEW, ignore_eos=True)  # prefilled on the decode worker instead
    await assert_clean(dc)  # the abandoned reservation's quarantine (1 s) over: every block free
    health = await pc.health()
    assert not health.healthy and "RankLost" in health.error, health

    req = GenerateRequest("stream", prompt[:20], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    got, error, killed = [], None, False
    async for batch in local_stream(dc, req):
        got += batch.token_ids
        error = batch.error or error
        if len(got) >= 20 and not killed:
            [rank] = rank_children(d)
            rank.kill()
            killed = True
    assert error and error.startswith(WORKER_LOST) and len(got) < 400, (error, len(got))
    assert got == hf_greedy(model, prompt[:20], len(got), ignore_eos=True)
    assert not (await dc.health()).healthy
    # SIGTERM (a pod's deletion) stops a worker whose engine failed at once: none of its
    # requests can finish, so it does not wait out the drain's grace for them
    for w in (d, p):
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(5) == 0
        assert "at once: the engine had failed (worker lost a tensor-parallel rank" in w.log.read_text()

async def with_usage(stream):
    """(token ids, the last batch: its usage)."""
    out, last = [], None
    async for b in stream:
        out += b.token_ids
        last = b
    return out, last


def complete(url: str, model: str, prompt: list[int], n: int = NEW) -> dict:
    body = {"model": os.path.basename(model), "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def rank_pids() -> list[int]:
    """The processes of tensor-parallel ranks run as Ray actors (worker_runtime/tp_ray.py)."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::RankActor")]


async def stream_to_end(client: httpx.AsyncClient, model: str, prompt: list[int], n: int, started: asyncio.Event):
    """(token ids, the error event's message or None); the stream must end with [DONE]."""
    body = {"model": os.path.basename(model), "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    ids, error, done = [], None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:  # refused before its first token: the error JSON says why
            return [], f"{r.status_code}: {json.loads(await r.aread())['error']['message']}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                ids.extend(chunk["choices"][0]["token_ids"] or [])
                if len(ids) >= 20:
                    started.set()
    assert done, "the stream ended without [DONE]"
    return ids, error


def test_colocated_ranks_through_http_and_a_rank_killed_mid_stream(serve, checkpoints):
    """One decode worker of 2 ranks holding the one KV head twice, its cache small enough
    to preempt, prefills chunked at 64 tokens: HTTP answers equal transformers'. Then
    rank 1's process is killed under three streams: the worker fails and is replaced; the
    streams that had begun end with their whole answer, moved to the new worker as when a
    worker process dies (tokens exact across the move), any not yet begun gets a clear
    503; the new worker answers exactly with none of its blocks held."""
    model = str(checkpoints["llama-kv1"])
    srv = serve("--colocated", "--decode", "1", "--tensor-parallel-size", "2", "--model", model,
                "--block-size", "16", "--num-blocks", "16", "--max-num-batched-tokens", "64")
    [worker] = srv.pools()["decode"]["workers"]
    assert worker["tensor_parallel_size"] == 2
    prompts = random_prompts([9, 100, 130, 70, 33], seed=61)
    prompts.append(prompts[1][:96] + [11, 12])  # a prefix hit on the 100-token prompt's blocks

    async def all_at_once():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            async def one(p, n=40):
                body = {"model": os.path.basename(model), "prompt": p, "max_tokens": n, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()
            first = await one(prompts[1])  # cached, then the one that shares its prefix, then the rest at once
            hit = await one(prompts[5])
            # 130 + 100 and 70 + 100 tokens need 15 and 11 of the 16 blocks: one of them is
            # preempted. One request with the four prompts: the router starts them together (as
            # separate requests on a loaded host they could run one after another)
            rest = await one(prompts[:1] + prompts[2:5], 100)
            return [first, hit, *({"choices": [c]} for c in sorted(rest["choices"], key=lambda c: c["index"]))]

    answers = asyncio.run(all_at_once())
    for i, a in zip([1, 5, 0, 2, 3, 4], answers):
        n = 40 if i in (1, 5) else 100
        assert a["choices"][0]["token_ids"] == hf_greedy(model, prompts[i], n, ignore_eos=True), f"prompt {i}"
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    assert srv.metrics("http://" + worker["metrics"] + "/metrics")["tandem:num_preemptions_total"] > 0

    ranks = rank_pids()
    assert len(ranks) == 1, ranks
    long = random_prompts([20, 25, 30], seed=62)
    expect = [hf_greedy(model, p, 150, ignore_eos=True) for p in long]

    async def kill_under_streams():
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=srv.url, timeout=180) as c:
            tasks = [asyncio.create_task(stream_to_end(c, model, p, 150, started)) for p in long]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(ranks[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(kill_under_streams())
    for (ids, error), want in zip(results, expect):
        # whole, and exact across the move to the new worker; or, for a request not yet
        # started when its only worker died, a clear refusal (no worker to move it to yet)
        assert (error is None and ids == want) or (error and "decode" in error and ids == want[:len(ids)]), error
    assert any(error is None for _, error in results), results  # the one 20 tokens in was moved
    log = open(srv.log_path).read()
    assert "worker lost a tensor-parallel rank" in log and "migrating" in log

    deadline = time.monotonic() + 120
    while True:  # the replacement, routable
        workers = srv.pools()["decode"]["workers"]
        if [w["worker_id"] for w in workers if w["routable"]] and workers[0]["worker_id"] != worker["worker_id"]:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)
    assert complete(srv.url, model, long[0], 30)["choices"][0]["token_ids"] == expect[0][:30]
    new = srv.pools()["decode"]["workers"][0]
    assert new["tensor_parallel_size"] == 2 and len(rank_pids()) == 1

    asyncio.run(worker_settles_clean(new))


@pytest.mark.parametrize("name,p_tp,d_tp,extra", [
    ("qwen3_moe", 2, 1, ()),
    ("llama-kv1", 2, 2, ("--speculative-method", "ngram", "--no-adaptive-speculation")),
    ("gemma2", 2, 2, ()),
    ("phi3", 1, 2, ()),
])
def test_disaggregated_ranks_through_http(serve, checkpoints, name, p_tp, d_tp, extra):
    """Prefill and decode workers of 2 and 1 ranks (Qwen3-MoE: q/k norms, experts split
    by their intermediate size), 2 and 2 (Llama with one KV head on both sides, verifying
    n-gram drafts on both decode ranks), Gemma 2 on 2 and 2 (soft caps; a 48-token window its 90-token
    prompt passes; its windowed and global layers in KV groups of their own, each with its
    tables, engine/kv_groups.py: the handoff writes every group's blocks), and Phi-3 on 1
    and 2 (LongRoPE from 64 positions: the 90-token prompt long throughout, the 60-token
    one computed again by the decode worker as it grows past 64): HTTP answers equal
    transformers'."""
    model = str(checkpoints[name])
    srv = serve("--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", str(p_tp),
                "--decode-tensor-parallel-size", str(d_tp), "--model", model, "--block-size", "16",
                "--local-prefill-threshold", "0", "--spill-prefill-s", "1000", "--transport", "tcp", *extra)
    pools = srv.pools()
    assert [w["tensor_parallel_size"] for w in pools["prefill"]["workers"]] == [p_tp]
    assert [w["tensor_parallel_size"] for w in pools["decode"]["workers"]] == [d_tp]
    prompts = random_prompts([7, 40, 60, 90], seed=63)
    for p in prompts:
        assert complete(srv.url, model, p)["choices"][0]["token_ids"] == hf_greedy(model, p, NEW, ignore_eos=True)
    assert srv.metrics()["tandem:router_kv_transfer_bytes_total"] > 0  # prefilled on the prefill worker, handed off


def test_mixtral_colocated_through_http(serve, checkpoints):
    """Mixtral served on one colocated worker of 2 ranks with --enable-expert-parallel
    (each rank holding 2 of the 4 experts whole): a prefix hit and preemptions among
    concurrent requests; HTTP answers equal transformers'; /metrics counts each expert's
    tokens."""
    model = str(checkpoints["mixtral"])
    srv = serve("--colocated", "--decode", "1", "--model", model, "--block-size", "16", "--num-blocks", "16",
                "--max-num-batched-tokens", "48", "--tensor-parallel-size", "2", "--enable-expert-parallel")
    [worker] = srv.pools()["decode"]["workers"]
    assert worker["tensor_parallel_size"] == 2
    assert worker["experts"] == "4 experts, 2 a token; expert parallel, 2 a rank"
    prompts = random_prompts([130, 3, 61, 17], seed=64)
    hit = prompts[0][:96] + [5, 6]
    assert complete(srv.url, model, prompts[0], 2 * NEW)["choices"][0]["token_ids"] == hf_greedy(
        model, prompts[0], 2 * NEW, ignore_eos=True)
    answer = complete(srv.url, model, hit, 2 * NEW)
    assert answer["choices"][0]["token_ids"] == hf_greedy(model, hit, 2 * NEW, ignore_eos=True)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96

    # the four prompts in one request (a prompt list): the router starts them together. 60
    # tokens each, so that the three short ones alone outgrow the 16 blocks (4 + 5 + 8 at
    # the end): in whatever order they arrive, and even with the long one held back for
    # room, they run at once and preempt (with 48 each the short three fit in exactly 16,
    # so an order that admitted them first and the long one after them preempted none:
    # the likely story of a CI run that counted no preemption)
    body = {"model": os.path.basename(model), "prompt": prompts, "max_tokens": 5 * NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for p, c in zip(prompts, choices, strict=True):
        assert c["token_ids"] == hf_greedy(model, p, 5 * NEW, ignore_eos=True)
    text = httpx.get("http://" + worker["metrics"] + "/metrics").text
    per_expert = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("tandem:moe_expert_tokens_total{")]
    assert len(per_expert) == 4 and sum(n > 0 for n in per_expert) >= 2, per_expert
    m = srv.metrics("http://" + worker["metrics"] + "/metrics")
    assert m["tandem:num_preemptions_total"] > 0 and m["tandem:moe_expert_load_imbalance"] >= 1
