"""Decode engine on a real model: staggered arrivals, priorities, preemption by
recompute, reservations filled from outside, streaming, stop strings; every greedy
output equals transformers'."""

import asyncio

import pytest
import torch

from decode_worker.async_engine import AsyncEngine
from decode_worker.llm import LLM
from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.block_pool import BlockPool
from engine.config import CacheConfig, SchedulerConfig
from engine.plan import SampleRow, SeqWork, StepPlan
from engine.sampling_params import SamplingParams
from engine.scheduler import NoCapacity
from engine.sequence import BATCH, INTERACTIVE
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model


def engine_for(path, num_blocks=256, **sched) -> LLMEngine:
    sched = {"max_num_batched_tokens": 64, "max_model_len": 1024, **sched}
    return LLMEngine.from_config(
        EngineConfig(model=str(path), cache=CacheConfig(num_blocks=num_blocks), scheduler=SchedulerConfig(**sched))
    )


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


class OutsidePrefill:
    """A second runner on the same weights that prefills a prompt and copies its KV into
    another engine's reserved blocks: what a prefill worker plus transport do."""

    def __init__(self, path):
        self.engine = engine_for(path, num_blocks=64)
        self.pool = BlockPool(64, self.engine.pool.block_size)

    def fill(self, target: LLMEngine, seq_id, prompt, reservation, params) -> int:
        bs = self.pool.block_size
        blocks = self.pool.allocate((len(prompt) + bs - 1) // bs)
        plan = StepPlan()
        plan.add(SeqWork(seq_id, prompt, 0, blocks, SampleRow(params, [], prompt)))
        first = self.engine.runner.execute(plan).token_ids[seq_id]
        skip = reservation.num_cached_tokens // bs  # blocks the target already holds
        src = torch.tensor(blocks[skip:])
        dst = torch.tensor(reservation.block_ids[skip:])
        target.runner.kv_cache.kv[:, :, dst] = self.engine.runner.kv_cache.kv[:, :, src]
        self.pool.release(blocks)
        return first


def test_staggered_priorities_preemption_and_reservations(builtin_dir):
    # 20 blocks of 16 tokens is too small for everyone at once: preemption must happen
    engine = engine_for(builtin_dir, num_blocks=20, max_num_batched_tokens=48, max_num_seqs=16)
    outside = OutsidePrefill(builtin_dir)
    lengths = [5, 40, 17, 90, 33, 64, 8, 120, 16, 70]
    prompts = random_prompts(lengths, seed=11)
    max_tokens = [30, 12, 45, 20, 60, 25, 40, 10, 35, 50]
    priorities = [INTERACTIVE, BATCH] * 5
    arrive_at = [0, 0, 1, 3, 3, 6, 9, 14, 20, 27]  # step at which each request shows up
    reserved = {3, 8}  # these are prefilled "remotely"
    reserved_ok = set()
    got = {str(i): [] for i in range(len(prompts))}
    pending = set(range(len(prompts)))
    for step in range(2000):
        for i in sorted(pending):
            if arrive_at[i] <= step:
                sid, params = str(i), greedy(max_tokens[i])
                if i in reserved:
                    try:
                        res = engine.reserve(sid, prompts[i], params, priorities[i])
                    except NoCapacity:
                        continue  # no room now: the router would retry
                    reserved_ok.add(i)
                    first = outside.fill(engine, sid, prompts[i], res, params)
                    ev = engine.mark_landed(sid, first)
                    got[sid].append(ev.token_id)
                else:
                    engine.add_request(sid, prompts[i], params, priorities[i])
                pending.discard(i)
        if not pending and not engine.has_work():
            break
        for ev in engine.step():
            if ev.token_id is not None:
                got[ev.seq_id].append(ev.token_id)
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert reserved_ok == reserved
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(builtin_dir, p, max_tokens[i], ignore_eos=True), f"request {i}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_reservation_reuses_decode_side_prefix_cache(builtin_dir):
    engine = engine_for(builtin_dir)
    outside = OutsidePrefill(builtin_dir)
    [prefix] = random_prompts([48], seed=12)
    a, b = prefix + [7, 8, 9], prefix + [10, 11]
    for sid, prompt in (("a", a), ("b", b)):
        res = engine.reserve(sid, prompt, greedy(6))
        if sid == "b":
            assert res.num_cached_tokens == 48  # a's three full prompt blocks
        first = outside.fill(engine, sid, prompt, res, greedy(6))
        engine.mark_landed(sid, first)
    out = {"a": [], "b": []}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    assert [hf_greedy(builtin_dir, a, 6, True)[0]] + out["a"] == hf_greedy(builtin_dir, a, 6, True)
    assert [hf_greedy(builtin_dir, b, 6, True)[0]] + out["b"] == hf_greedy(builtin_dir, b, 6, True)
    engine.check_integrity()


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "steps-ahead"])
def test_async_streaming_and_abort(builtin_dir, ahead):
    """`ahead`: asynchronous scheduling (tests/model/test_async_scheduling.py) forced on,
    so the abort comes between a step's launch and its collect."""
    prompts = random_prompts([9, 30, 3], seed=13)

    async def main():
        aeng = AsyncEngine(engine_for(builtin_dir, async_scheduling=ahead))
        aeng.start()
        try:

            async def collect(i):
                toks = []
                async for ev in aeng.generate(f"s{i}", prompts[i], greedy(15)):
                    toks.append(ev.token_id)
                return toks

            outs = await asyncio.gather(*(collect(i) for i in range(3)))
            # a consumer that walks away mid-stream aborts its request
            agen = aeng.generate("gone", prompts[0], greedy(500))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(200):
                if not aeng.engine.has_work():
                    break
                await asyncio.sleep(0.01)
            assert not aeng.engine.has_work()
            await aeng.call(aeng.engine.check_integrity)
            assert (aeng.engine.steps_ahead > 0) == ahead
            return outs
        finally:
            aeng.stop()

    outs = asyncio.run(main())
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(builtin_dir, p, 15, ignore_eos=True)


def test_offline_llm_stop_strings_never_emit_partial(builtin_dir):
    llm = LLM(str(builtin_dir), num_blocks=128)
    prompt = "The weather today is"
    full = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 20
    stop = full.text[10:14]
    cut = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop,)), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    keep = llm.generate(
        prompt,
        SamplingParams(max_tokens=40, temperature=0, stop=(stop,), include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert keep.text == full.text[: full.text.index(stop) + len(stop)]
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible_across_batches(builtin_dir):
    llm = LLM(str(builtin_dir), num_blocks=128)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    [alone] = llm.generate([random_prompts([12], seed=5)[0]], params, use_tqdm=False)
    crowd = llm.generate(
        random_prompts([30, 12, 5], seed=6)[:1] + random_prompts([12], seed=5) + random_prompts([9], seed=8),
        [SamplingParams(max_tokens=20, temperature=1.0), params, SamplingParams(max_tokens=20, temperature=1.0)],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = llm.generate(
        [random_prompts([12], seed=5)[0]] * 2, SamplingParams(max_tokens=20, temperature=1.0), use_tqdm=False
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_async_text_stream_with_stop_strings(builtin_dir):
    llm = LLM(str(builtin_dir), num_blocks=128)
    prompt = llm.tokenizer.encode("The weather today is")
    full = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    stop = full.text[12:15]

    async def main(params):
        aeng = AsyncEngine(engine_for(builtin_dir))
        aeng.start()
        try:
            events = [ev async for ev in aeng.generate_text("t", prompt, params, llm.tokenizer)]
            for _ in range(200):
                if not aeng.engine.has_work():
                    break
                await asyncio.sleep(0.01)
            await aeng.call(aeng.engine.check_integrity)
            return events
        finally:
            aeng.stop()

    plain = asyncio.run(main(SamplingParams(max_tokens=40, temperature=0)))
    assert "".join(e.text for e in plain) == full.text and [e.token_id for e in plain] == full.token_ids
    stopped = asyncio.run(main(SamplingParams(max_tokens=40, temperature=0, stop=(stop,))))
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"
    # exactly the text before the stop string: no part of it was ever shown
    assert "".join(e.text for e in stopped) == full.text[: full.text.index(stop)]


def test_small_steps_run_on_one_thread_when_asked(builtin_dir):
    """serial_step_work: a step whose tokens x weight parameters fit runs on one torch
    thread, a bigger one on all (a worker sharing its cores with the serving path)."""
    from engine.config import DeviceConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = LLMEngine.from_config(EngineConfig(model=str(builtin_dir), dtype="bfloat16",
                                                    cache=CacheConfig(num_blocks=64),
                                                    device=DeviceConfig(num_threads=2, serial_step_work=1)))
        runner = engine.runner
        assert runner.weight_params > 10**6  # counted before the linear layers were packed (bf16)
        runner.serial_step_work = 2 * runner.weight_params  # up to 2 tokens: one thread
        seen = []
        real = runner._prepare
        runner._prepare = lambda plan: (seen.append((plan.num_tokens, torch.get_num_threads())), real(plan))[1]
        engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0))
        while engine.has_work():
            engine.step()
        assert seen[0] == (20, 2) and all(t == 1 for n, t in seen[1:]) and len(seen) == 3
    finally:
        torch.set_num_threads(before)
