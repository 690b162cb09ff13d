"""Disaggregated serving across processes: a prefill worker and a decode worker,
each its own process, KV over NIXL or TCP. Greedy outputs equal transformers';
every failure path ends with both workers' integrity checks clean."""

import asyncio
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from protos import tandem_pb2 as pb
from router.backend import BackendError, GenerateRequest
from router.worker_client import _decode_request, disaggregated_stream, local_stream, run_prefill
from tests.oracle import hf_greedy, random_prompts
from worker_runtime.client import wait_ready

pytestmark = pytest.mark.cluster

QUARANTINE = ("--reservation-quarantine-s", "1")


def req(rid, prompt, n=12, **kw):
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw))


async def collect(stream):
    out = []
    async for b in stream:
        out += b.token_ids
    return out


async def until_stats(client, ok, what: str, timeout: float = 30.0):
    """Poll `client`'s stats until `ok(stats)`: the stage a test names is reached, not
    slept towards."""
    deadline = time.monotonic() + timeout
    while not ok(s := await client.stats()):
        assert time.monotonic() < deadline, f"{client.worker_id}: never reached: {what} ({s})"
        await asyncio.sleep(0.02)
    return s


async def assert_clean(*clients, timeout=10.0):
    """Integrity checks pass and every block is free again (quarantines ended)."""
    deadline = time.monotonic() + timeout
    for c in clients:
        while True:
            h = await c.check_integrity()
            s = await c.stats()
            if h.healthy and s.num_free_blocks == s.num_blocks:
                break
            assert time.monotonic() < deadline, (
                f"{c.worker_id}: {h.error or 'blocks still held'} ({s.num_free_blocks}/{s.num_blocks} free, "
                f"{s.num_running} running, {s.num_waiting} waiting, {s.num_awaiting_kv} awaiting KV)"
            )
            await asyncio.sleep(0.2)


async def started(spawn, decode_args=(), transport="tcp", **prefill):
    """A decode worker and a prefill worker, both ready: (decode, prefill, their clients)."""
    d, p = spawn.together(("decode", "decode-0", {"transport": transport, "args": decode_args}),
                          ("prefill", "prefill-0", {"transport": transport, **prefill}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    return d, p, dc, pc


# the decode worker's steps also planned ahead (asynchronous scheduling, CUDA's default, forced on here):
# landings, reservations and aborts then come between a step's launch and its collect
AHEAD = ("--async-scheduling", "--metrics-port", "0")


@pytest.mark.parametrize("transport,decode_args", [("tcp", ()), ("nixl", ()), ("tcp", AHEAD)],
                         ids=["tcp", "nixl", "tcp-async"])
async def test_sixteen_concurrent_requests_match_transformers(spawn, model_path, transport, decode_args):
    d, p = spawn.together(("decode", "decode-0", dict(transport=transport, args=decode_args)),
                          ("prefill", "prefill-0", dict(transport=transport,
                                                        args=("--max-num-batched-tokens", "128"))))
    dc, pc = d.client(), p.client()
    decode_info = await wait_ready(dc)
    await wait_ready(pc)
    [shared] = random_prompts([80], seed=21)  # a full block at 16 or 64 tokens a block
    prompts = random_prompts([1, 5, 15, 16, 17, 31, 33, 64, 100, 160, 250], seed=22)
    prompts += [shared + s for s in random_prompts([3, 9, 17, 30, 1], seed=23)]  # prefix-cache hits
    n_new = [12, 20, 5, 16, 9, 30, 12, 8, 25, 6, 14, 10, 18, 7, 22, 11]
    outs = await asyncio.gather(
        *(
            collect(disaggregated_stream(pc, dc, req(f"r{i}", pr, n_new[i]), fallback_local=False))
            for i, pr in enumerate(prompts)
        )
    )
    for i, (pr, out) in enumerate(zip(prompts, outs)):
        assert out == hf_greedy(model_path, pr, n_new[i], ignore_eos=True), f"request {i}"
    stats = await pc.stats()
    assert stats.transport == transport and stats.prefix_cache_hits > 0
    if decode_args == AHEAD:  # the decode worker's steps did go ahead, as its /metrics counts them
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://{decode_info.metrics_address}/metrics", timeout=10)).text
        ahead = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "tandem:worker_steps_planned_ahead_total"]
        assert ahead and ahead[0] > 0
    await assert_clean(dc, pc)


async def test_prefill_worker_killed_mid_prefill(spawn, model_path):
    d, p = spawn.together(("decode", "decode-0", dict(args=QUARANTINE)),
                          ("prefill", "prefill-0", dict(faults="prefill_step_delay_s=0.25",
                                                        args=("--max-num-batched-tokens", "32"))))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    [prompt] = random_prompts([320], seed=24)  # 10 chunks of 32 at 0.25 s each
    task = asyncio.create_task(collect(disaggregated_stream(pc, dc, req("long", prompt), fallback_local=True)))
    await until_stats(pc, lambda s: s.num_running == 1, "the prefill in flight when it dies")
    p.kill()
    out = await asyncio.wait_for(task, 60)  # prefilled locally on the decode worker instead
    assert out == hf_greedy(model_path, prompt, 12, ignore_eos=True)
    # without the fallback the client gets a clear error instead
    p2 = spawn("prefill", "prefill-1", faults="prefill_step_delay_s=0.25", args=("--max-num-batched-tokens", "32"))
    pc2 = p2.client()
    await wait_ready(pc2)
    task = asyncio.create_task(collect(disaggregated_stream(pc2, dc, req("long2", prompt), fallback_local=False)))
    await until_stats(pc2, lambda s: s.num_running == 1, "the prefill in flight when it dies")
    p2.kill()
    with pytest.raises(BackendError, match="prefill failed: prefill worker prefill-1: UNAVAILABLE"):
        await asyncio.wait_for(task, 60)
    await assert_clean(dc)


async def test_injected_transfer_failure(spawn, model_path):
    d, p = spawn.together(("decode", "decode-0", dict(args=QUARANTINE)),
                          ("prefill", "prefill-0", dict(faults="fail_transfers=1")))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    [prompt] = random_prompts([40], seed=25)
    with pytest.raises(BackendError, match="injected transfer failure"):
        await collect(disaggregated_stream(pc, dc, req("x", prompt), fallback_local=False))
    out = await collect(disaggregated_stream(pc, dc, req("y", prompt), fallback_local=True))
    assert out == hf_greedy(model_path, prompt, 12, ignore_eos=True)
    await assert_clean(dc, pc)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
async def test_prompt_the_decode_worker_holds_whole(spawn, model_path, transport):
    """A prompt of whole blocks that the decode worker already caches entirely (the same
    prompt again): its reservation needs no KV written, only the first token. The prefill
    worker still sends the last block (the decode side never counts the whole prompt as
    cached), so the request is exact and the prefill worker lives on."""
    _, _, dc, pc = await started(spawn, transport=transport)
    [prompt] = random_prompts([128], seed=27)  # whole blocks at 16 or 64 tokens a block
    want = hf_greedy(model_path, prompt, 12, ignore_eos=True)
    epoch = (await pc.health()).epoch
    cached = []
    for rid in ("first", "again", "third"):
        out, hit = [], 0
        async for b in disaggregated_stream(pc, dc, req(rid, prompt), fallback_local=False):
            out += b.token_ids
            hit = max(hit, b.cached_tokens)
        assert out == want, rid
        cached.append(hit)
    # the repeats hit the decode worker's cache: all but the last block
    assert cached[0] == 0 and cached[1] == cached[2] and 0 < cached[1] < len(prompt), cached
    health = await pc.health()
    assert health.healthy and health.epoch == epoch, health.error
    await assert_clean(dc, pc)


async def test_a_refused_kv_write_fails_its_request_only(spawn, model_path):
    """A prefill whose target names blocks the decode worker does not have (a caller's
    bug, sent straight to the prefill worker): the transport refuses the write, that
    request fails with the reason, and the prefill worker serves the next one (no engine
    death, no restart, no block held)."""
    _, _, dc, pc = await started(spawn, QUARANTINE)
    [warm, prompt] = random_prompts([20, 70], seed=28)
    await collect(disaggregated_stream(pc, dc, req("warm", warm)))  # the prefill worker now knows this peer
    epoch = (await pc.health()).epoch
    r = req("bad", prompt)
    call = dc.stub.Decode(_decode_request(r, pb.REMOTE_PREFILL, 30.0), metadata=dc.metadata)
    first = await call.read()
    assert first.WhichOneof("kind") == "reservation"
    res = pb.Reservation()
    res.CopyFrom(first.reservation)
    res.block_ids[-1] = 1 << 30  # no such block on the decode worker
    outcome = await asyncio.wait_for(run_prefill(pc, dc, r, res, timeout=30.0), 40)
    assert outcome.reply is None and "out of range" in outcome.error, outcome.error
    call.cancel()
    health = await pc.health()
    assert health.healthy and health.epoch == epoch, health.error
    out = await collect(disaggregated_stream(pc, dc, req("after", prompt), fallback_local=False))
    assert out == hf_greedy(model_path, prompt, 12, ignore_eos=True)
    await assert_clean(dc, pc)


async def test_decode_worker_killed_after_reserving(spawn, model_path):
    d, _, dc, pc = await started(spawn)
    [warm, prompt] = random_prompts([20, 70], seed=26)
    await collect(disaggregated_stream(pc, dc, req("warm", warm)))  # the prefill worker now knows this peer
    r = req("doomed", prompt)
    call = dc.stub.Decode(_decode_request(r, pb.REMOTE_PREFILL, 30.0), metadata=dc.metadata)
    first = await call.read()
    assert first.WhichOneof("kind") == "reservation"
    d.kill()
    outcome = await asyncio.wait_for(run_prefill(pc, dc, r, first.reservation, timeout=30.0), 40)
    assert outcome.reply is None and "failed" in outcome.error
    call.cancel()
    await assert_clean(pc)


@pytest.mark.parametrize("decode_args", [(), AHEAD], ids=["sync", "async"])
async def test_abort_at_every_stage(spawn, model_path, decode_args):
    d = spawn("decode", "decode-0", args=QUARANTINE + decode_args)
    p = spawn(
        "prefill",
        "prefill-0",
        faults="prefill_step_delay_s=0.2,transfer_delay_s=1.0",
        args=("--max-num-batched-tokens", "32"),
    )
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    prompts = random_prompts([100, 100, 100, 100], seed=27)

    # 1. reserved on D, never prefilled: the stream is cancelled
    call = dc.stub.Decode(_decode_request(req("a1", prompts[0]), pb.REMOTE_PREFILL, 30.0), metadata=dc.metadata)
    assert (await call.read()).WhichOneof("kind") == "reservation"
    call.cancel()
    # 2. mid-prefill on P (4 chunks at 0.2 s), 3. mid-transfer (held 1 s), 4. mid-decode
    for rid, prompt, delay in (("a2", prompts[1], 0.3), ("a3", prompts[2], 1.2)):
        task = asyncio.create_task(collect(disaggregated_stream(pc, dc, req(rid, prompt), fallback_local=False)))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    stream = local_stream(dc, req("a4", prompts[3], n=500))
    await stream.__anext__()
    await stream.aclose()
    # 5. the Abort RPC (an operator's, not the router's): the running stream ends at once
    # with finish_reason abort; ids it does not hold are not found, on either worker
    stream = local_stream(dc, req("a5", prompts[3], n=500))
    await stream.__anext__()
    assert await dc.abort("a5") is True

    async def last_batch():
        last = None
        async for b in stream:
            last = b
        return last

    last = await asyncio.wait_for(last_batch(), 10.0)
    assert last.finished and last.finish_reason == "abort" and "Abort" in last.error
    assert await dc.abort("a5") is False and await pc.abort("nope") is False
    await assert_clean(dc, pc)
    # the pool still serves correctly afterwards
    out = await collect(disaggregated_stream(pc, dc, req("after", prompts[0])))
    assert out == hf_greedy(model_path, prompts[0], 12, ignore_eos=True)
    await assert_clean(dc, pc)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
async def test_a_prefill_cancelled_before_it_wrote_frees_the_reservation_at_once(spawn, model_path, transport):
    """The decode worker quarantines the reservation of a request cancelled before its KV
    landed, since a late write could still land (here for 60 s). A prefill worker whose
    job ends before it posted any write says so, and the blocks come back at once."""
    _, _, dc, pc = await started(spawn, ("--reservation-quarantine-s", "60"), transport=transport,
                                 faults="prefill_step_delay_s=0.3", args=("--max-num-batched-tokens", "32"))
    prompts = random_prompts([100, 100, 100], seed=29)
    tasks = [asyncio.create_task(collect(disaggregated_stream(pc, dc, req(f"c{i}", p), fallback_local=False)))
             for i, p in enumerate(prompts)]
    # every reservation made, the first prompt mid-prefill (4 chunks of 0.3 s), the others queued
    await until_stats(dc, lambda s: s.num_awaiting_kv == 3, "three reservations")
    await until_stats(pc, lambda s: s.num_running >= 1 and s.num_running + s.num_waiting == 3, "one prompt prefilling")
    for task in tasks:
        task.cancel()
    for task in tasks:
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_clean(dc, pc, timeout=5.0)
    out = await collect(disaggregated_stream(pc, dc, req("after", prompts[0])))
    assert out == hf_greedy(model_path, prompts[0], 12, ignore_eos=True)
    await assert_clean(dc, pc)


async def test_a_reservation_cancelled_before_it_was_sent_is_not_quarantined(spawn, model_path):
    """A Decode stream cancelled while the decode worker is still making its reservation:
    the reservation never reached the router, so no prefill worker can write into it, and
    its blocks are freed at once rather than held for the quarantine (60 s here)."""
    d, p = spawn.together(("decode", "decode-0", dict(faults="reserve_delay_s=0.6",
                                                      args=("--reservation-quarantine-s", "60"))),
                          ("prefill", "prefill-0", {}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    [prompt] = random_prompts([100], seed=31)
    call = dc.stub.Decode(_decode_request(req("u1", prompt), pb.REMOTE_PREFILL, 30.0), metadata=dc.metadata)
    await asyncio.sleep(0.2)  # the engine thread is inside the reservation's delay
    call.cancel()
    await asyncio.sleep(0.6)  # the reservation is made, then the abort runs
    await assert_clean(dc, pc, timeout=5.0)
    out = await collect(disaggregated_stream(pc, dc, req("after", prompt)))
    assert out == hf_greedy(model_path, prompt, 12, ignore_eos=True)
    await assert_clean(dc, pc)


async def test_decode_worker_restarted_on_the_same_address(spawn, model_path):
    d, p = spawn.together(("decode", "decode-0", {}),
                          ("prefill", "prefill-0", {}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    prompts = random_prompts([30, 45], seed=28)
    assert await collect(disaggregated_stream(pc, dc, req("before", prompts[0]), fallback_local=False)) == hf_greedy(
        model_path, prompts[0], 12, ignore_eos=True
    )
    old_epoch = (await dc.health()).epoch
    port = d.port
    d.kill()
    d2 = spawn("decode", "decode-0", port=port)  # same name, same address, new incarnation
    dc2 = d2.client()
    assert (await wait_ready(dc2)).epoch != old_epoch
    out = await collect(disaggregated_stream(pc, dc2, req("after", prompts[1]), fallback_local=False))
    assert out == hf_greedy(model_path, prompts[1], 12, ignore_eos=True)
    await assert_clean(dc2, pc)


async def test_sigterm_drains_a_decode_worker(spawn, model_path):
    """SIGTERM to a decode worker under load: the streams it accepted finish whole and
    exact, new requests are refused as retryable (503), the process exits 0 with one
    line about it and no backtrace."""
    import signal

    d = spawn("decode", "decode-0", args=("--shutdown-grace-s", "120"))
    dc = d.client()
    await wait_ready(dc)
    prompts = random_prompts([5, 9, 14, 20, 27, 33, 40, 48], seed=51)
    n = 300
    started = [asyncio.Event() for _ in prompts]

    async def one(i: int) -> list[int]:
        out = []
        async for b in local_stream(dc, req(f"drain-{i}", prompts[i], n=n)):
            out += b.token_ids
            started[i].set()
        return out

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    assert not any(t.done() for t in tasks)
    d.proc.send_signal(signal.SIGTERM)
    for _ in range(200):  # the drain begins once the worker's loop sees the signal
        if (await dc.health()).draining:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(BackendError) as refused:
        await collect(local_stream(dc, req("late", prompts[0], n=4)))
    assert refused.value.status == 503 and "draining" in str(refused.value)
    assert not all(t.done() for t in tasks), "every stream ended before the drain was seen: make them longer"
    outs = await asyncio.gather(*tasks)
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(model_path, prompt, n, ignore_eos=True)
    await dc.close()
    assert await asyncio.to_thread(d.proc.wait, 60) == 0
    log = d.log.read_text()
    assert "decode decode-0 stopped on SIGTERM" in log and "all 8 finished" in log, log[-2000:]
    assert "Traceback" not in log


async def test_token_feed_carries_every_token_and_the_decode_stream_ends_with_the_request(spawn, model_path):
    """With a Feed open and named in the DecodeRequest, the tokens of all requests come
    on the feed (equal to transformers'), their Decode streams carry nothing and end
    cleanly; an unknown feed id sends the tokens on the request's own stream; a feed
    closed mid-request ends that request's stream with UNAVAILABLE and frees its blocks."""
    d = spawn("decode", "decode-0")
    dc = d.client()
    await wait_ready(dc)
    prompts = random_prompts([5, 17, 40, 90], seed=41)
    feed = dc.stub.Feed(pb.FeedRequest(feed_id="f1"), metadata=dc.metadata)
    got: dict[str, list[int]] = {}

    async def read_feed():
        async for batch in feed:
            for item in batch.items:
                got.setdefault(item.request_id, []).extend(item.tokens.token_ids)

    reader = asyncio.create_task(read_feed())
    await asyncio.sleep(0.5)  # the worker has registered the feed

    async def decode(rid, prompt, feed_id):
        call = dc.stub.Decode(_decode_request(req(rid, prompt), pb.LOCAL_PREFILL, 0.0, feed_id), metadata=dc.metadata)
        return [ev async for ev in call]

    on_stream = await asyncio.gather(*(decode(f"f{i}", p, "f1") for i, p in enumerate(prompts)))
    assert on_stream == [[] for _ in prompts]
    for i, p in enumerate(prompts):
        assert got[f"f{i}"] == hf_greedy(model_path, p, 12, ignore_eos=True), f"request {i}"
    fallback = await decode("u", prompts[0], "no-such-feed")
    assert [t for ev in fallback for t in ev.tokens.token_ids] == got["f0"]

    long = dc.stub.Decode(_decode_request(req("long", prompts[3], n=2000), pb.LOCAL_PREFILL, 0.0, "f1"),
                          metadata=dc.metadata)
    deadline = time.monotonic() + 30
    while len(got.get("long", [])) < 5:
        assert time.monotonic() < deadline, "the long request's tokens never came on the feed"
        await asyncio.sleep(0.05)
    feed.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in long:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "feed" in err.value.details()
    reader.cancel()
    await assert_clean(dc)


async def test_router_streams_through_the_feed(spawn, model_path):
    """local_stream and disaggregated_stream open this client's feed on first use and
    read their tokens from it; the results equal transformers'."""
    from router import token_feed

    d, p = spawn.together(("decode", "decode-0", {}),
                          ("prefill", "prefill-0", {}))
    dc, pc = d.client(), p.client()
    await wait_ready(dc)
    await wait_ready(pc)
    prompts = random_prompts([3, 33, 70], seed=42)
    outs = await asyncio.gather(*(collect(local_stream(dc, req(f"l{i}", pr))) for i, pr in enumerate(prompts)))
    outs += await asyncio.gather(*(collect(disaggregated_stream(pc, dc, req(f"d{i}", pr), fallback_local=False))
                                   for i, pr in enumerate(prompts)))
    for i, out in enumerate(outs):
        assert out == hf_greedy(model_path, prompts[i % 3], 12, ignore_eos=True), f"request {i}"
    reader = token_feed.reader_for(dc)
    assert reader.feed_id and reader._task is not None and not reader._task.done()
    await assert_clean(dc, pc)
