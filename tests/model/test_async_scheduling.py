"""Asynchronous scheduling (decode_worker/llm_engine.py `_step_ahead`): step n+1 planned and
launched on the tokens step n samples before they reach the host. On CPU it reorders the
same work, so these tests check what it must keep: the same tokens as a synchronous
engine (and as transformers), sequences that an EOS or stop id ends while the next step
already ran for them, preemption, seeded sampling and min_tokens, logprobs, and no block
left held (an abort between a launch and its collect: tests/model/test_decode_engine.py
`test_async_streaming_and_abort`). The GPU test (tests/gpu) checks the same
on a device where the steps really overlap."""

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from engine.plan import PENDING
from engine.sampling_params import SamplingParams
from engine.scheduler import _OutputAhead
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

LENGTHS = [1, 7, 15, 16, 17, 32, 33, 50, 95]


def make(path, asynchronous: bool | None, num_blocks=256, block_size=None, **sched) -> LLMEngine:
    sched = {"max_num_batched_tokens": 64, "max_model_len": 1024, **sched}
    cache = CacheConfig(num_blocks=num_blocks, **({"block_size": block_size} if block_size else {}))
    return LLMEngine.from_config(EngineConfig(model=str(path), cache=cache,
                                              scheduler=SchedulerConfig(async_scheduling=asynchronous, **sched)))


def run(engine: LLMEngine, prompts, params, logprobs: dict | None = None) -> tuple[list[list[int]], dict[str, str]]:
    """Every request to its end: each one's tokens and finish reason. `logprobs`, when
    given, gets each request's TokenLogprobs (or None) per token."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, each)):
        engine.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    reasons: dict[str, str] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.seq_id].append(ev.token_id)
                if logprobs is not None:
                    logprobs.setdefault(ev.seq_id, []).append(ev.logprobs)
            if ev.finished:
                reasons[ev.seq_id] = ev.finish_reason.value
    assert not engine.has_work()
    assert engine.scheduler.live() == []
    engine.check_integrity()  # no block referenced by anything: none leaked
    return [out[str(i)] for i in range(len(prompts))], reasons


def both(path, prompts, params, **kw):
    """The same requests through a synchronous and an asynchronous engine."""
    sync, ahead = make(path, False, **kw), make(path, True, **kw)
    got_sync, got_ahead = run(sync, prompts, params), run(ahead, prompts, params)
    assert sync.steps_ahead == 0
    assert ahead.steps_ahead > 0, "the test must run steps planned ahead"
    ahead.computed_as_sync = ahead.stats.num_tokens == sync.stats.num_tokens
    return got_sync, got_ahead, ahead


def test_off_by_default_on_cpu_and_refused_with_speculation(builtin_dir):
    assert make(builtin_dir, None).async_scheduling is False
    assert make(builtin_dir, True).async_scheduling is True
    with pytest.raises(ConfigError, match="speculative"):
        LLMEngine.from_config(EngineConfig(
            model=str(builtin_dir), cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(async_scheduling=True),
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)))


def test_greedy_tokens_equal_transformers_and_the_synchronous_engine(builtin_dir):
    """Different lengths, chunked prefill (a chunk that does not sample stops the steps
    ahead until every prompt is in), different max_tokens (sequences leave the batch on
    different steps)."""
    prompts = random_prompts(LENGTHS, seed=1)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    (sync, _), (ahead, reasons), engine = both(builtin_dir, prompts, params, max_num_batched_tokens=40)
    assert ahead == sync
    for p, sp, g in zip(prompts, params, ahead):
        assert g == hf_greedy(builtin_dir, p, sp.max_tokens, ignore_eos=True)
    assert set(reasons.values()) == {"length"}
    assert engine.steps_ahead >= 10
    assert engine.computed_as_sync  # a sequence max_tokens ends is not computed ahead for nothing


def test_a_stop_id_ends_a_sequence_the_next_step_already_ran_for(builtin_dir):
    """Stop ids are only known once the token is back, so the step launched ahead computed
    one more token for the sequence: it is dropped, and its blocks are freed."""
    prompts = random_prompts([12, 20, 33, 5], seed=3)
    free_run = make(builtin_dir, False)
    full, _ = run(free_run, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stops = [g[5 + 3 * i] for i, g in enumerate(full)]  # a token each prompt reaches mid-way
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(t,)) for t in stops]
    (sync, sync_reasons), (ahead, reasons), _ = both(builtin_dir, prompts, params)
    assert ahead == sync and reasons == sync_reasons
    for i, g in enumerate(ahead):
        assert g == full[i][: full[i].index(stops[i]) + 1]
        assert reasons[str(i)] == "stop"


def test_preemption_under_a_small_cache(builtin_dir):
    """Too few blocks for every sequence: a step that would need to preempt is planned by
    the ordinary scheduler; the tokens stay transformers'."""
    prompts = random_prompts([30, 41, 17, 25, 9, 36], seed=7)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (sync, _), (ahead, _), engine = both(builtin_dir, prompts, params, num_blocks=14, max_num_batched_tokens=48)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert ahead == sync
    for p, g in zip(prompts, ahead):
        assert g == hf_greedy(builtin_dir, p, 40, ignore_eos=True)


def test_requests_waiting_for_blocks_do_not_stop_the_steps_ahead(builtin_dir):
    """A KV-bound queue: requests wait for blocks, not for slots. The steps go ahead while
    no waiting request fits, and an ordinary step admits one as soon as it does."""
    prompts = random_prompts([17] * 12, seed=12)  # two blocks of 16 each, start to end
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = {"num_blocks": 9, "block_size": 16}  # four sequences at a time, the rest wait
    (sync, _), (ahead, _), engine = both(builtin_dir, prompts, params, **kw)
    assert ahead == sync
    for p, g in zip(prompts, ahead):
        assert g == hf_greedy(builtin_dir, p, 10, ignore_eos=True)
    assert engine.scheduler.num_preemptions == 0
    assert engine.steps_ahead > engine.stats.num_steps // 2, (engine.steps_ahead, engine.stats.num_steps)


def test_seeded_sampling_and_min_tokens_draw_as_the_synchronous_engine(builtin_dir):
    """A seeded draw's index is the token's place in the output, which a step planned
    ahead counts with the pending token; min_tokens bans the EOS until then."""
    prompts = random_prompts([12, 20, 7], seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=11 + i) for i in range(3)]
    params.append(SamplingParams(max_tokens=20, temperature=0, min_tokens=15))
    prompts.append(random_prompts([10], seed=9)[0])
    (sync, sync_reasons), (ahead, reasons), _ = both(builtin_dir, prompts, params)
    assert ahead == sync and reasons == sync_reasons
    assert len(ahead[3]) >= 15


def test_logprobs_come_back_with_the_tokens_a_step_ahead_samples(builtin_dir):
    """Logprobs are computed on the device with the tokens and read back with them: the
    same numbers as a synchronous step's, greedy and sampled rows alike."""
    prompts = random_prompts([12, 20, 9], seed=8)
    params = [SamplingParams(max_tokens=16, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]

    def with_logprobs(engine):
        lps: dict[str, list] = {}
        tokens, _ = run(engine, prompts, params, logprobs=lps)
        return {str(i): list(zip(toks, lps[str(i)])) for i, toks in enumerate(tokens)}

    sync, ahead = make(builtin_dir, False), make(builtin_dir, True)
    want, got = with_logprobs(sync), with_logprobs(ahead)
    assert ahead.steps_ahead >= 10
    assert got == want
    assert all(lp is not None and len(lp.top) == 3 for _, lp in got["0"])
    assert all(lp is None for _, lp in got["2"])


def test_steps_with_penalties_wait_for_their_tokens(builtin_dir):
    """Rows the sampler cannot finish on the device (penalties count the tokens so far)
    make their steps synchronous; once that request ends, the others' steps go ahead."""
    prompts = random_prompts([12, 20, 9], seed=8)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True)]
    (sync, _), (ahead, _), engine = both(builtin_dir, prompts, params)
    assert ahead == sync
    assert engine.steps_ahead < 30 - 12  # no step ahead while the penalised request ran


def test_the_output_seen_ahead_has_the_pending_token_last():
    ids = [4, 5, 6]
    ahead = _OutputAhead(ids)
    assert len(ahead) == 4
    assert list(ahead) == [4, 5, 6, PENDING]
    assert ahead[-1] == PENDING and ahead[0] == 4 and ahead[-2] == 6 and ahead[1:] == [5, 6, PENDING]
    with pytest.raises(IndexError):
        ahead[4]
    ids.append(7)  # a view: the token, once appended, is no longer pending
    assert len(ahead) == 5
