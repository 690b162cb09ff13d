"""Core lending (engine/cores.py) on a real engine: a worker pinned to one core runs its
steps on two threads while the other core's owner is idle, on one while it is busy, gives
its own core back when it goes idle, and makes the same greedy tokens as transformers
either way."""

import concurrent.futures as cf
import os

import pytest
import torch

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, DeviceConfig
from engine.cores import CoreTable, create_core_table
from engine.cpu_kernels import build
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy

pytestmark = pytest.mark.model

CORES = sorted(os.sched_getaffinity(0))


def _pinned_engine(builtin_dir, own, other, path):
    """An engine pinned to `own` that may borrow `other` through the ledger at `path`,
    and the list its steps append their thread counts to (call on the thread that runs
    it, as a worker's engine loop: binding pins that thread)."""
    torch.set_num_threads(1)  # what a worker pinned to one core starts with
    engine = LLMEngine.from_config(EngineConfig(
        model=str(builtin_dir), cache=CacheConfig(num_blocks=64),
        device=DeviceConfig(num_threads=1, cpu_affinity=own, core_table=path, shared_cores=own + other)))
    runner = engine.runner
    seen: list[int] = []
    real = runner._prepare
    runner._prepare = lambda plan: (seen.append(torch.get_num_threads()), real(plan))[1]
    return engine, seen


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_steps_borrow_the_idle_core_and_give_it_back(builtin_dir):
    if build.load_or_none() is None:
        pytest.skip("no cpu kernels build here (threads cannot be bound)")
    own, other = (CORES[0],), (CORES[1],)
    path = create_core_table("tandem-cores-test")
    peer = CoreTable(path, other, own + other)  # the other worker on this host
    prompt = list(range(40, 70))
    before = torch.get_num_threads()

    def run(peer_busy: bool):
        """On a thread of its own, as a worker's engine loop: binding pins that thread."""
        engine, seen = _pinned_engine(builtin_dir, own, other, path)
        runner = engine.runner
        (peer.busy if peer_busy else peer.idle)()
        engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0))
        out: list[int] = []
        while engine.has_work():
            out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
            assert peer.borrowable() == ()  # its own core is busy while it works
        # the helper of a two-thread team works at normal priority, and waits at SCHED_IDLE
        # once the engine is idle (engine/cores.py IdleHelpers)
        helpers = list(runner.helpers.tids) if runner.helpers is not None else []
        busy = [os.sched_getscheduler(t) for t in helpers]
        runner.mark_idle()
        idle = [os.sched_getscheduler(t) for t in helpers]
        assert peer.borrowable() == own  # and lendable once it is idle
        return out, seen, runner.lent_steps, (busy, idle)

    try:
        with cf.ThreadPoolExecutor(1) as pool:
            lent_tokens, lent_threads, lent_steps, lent_policies = pool.submit(run, False).result(timeout=300)
        with cf.ThreadPoolExecutor(1) as pool:
            own_tokens, own_threads, own_steps, own_policies = pool.submit(run, True).result(timeout=300)
    finally:
        peer.close()
        os.unlink(path)
        torch.set_num_threads(before)
    assert lent_threads == [2] * len(lent_threads) and lent_steps == len(lent_threads) == 12
    assert own_threads == [1] * len(own_threads) and own_steps == 0
    assert lent_tokens == own_tokens == hf_greedy(builtin_dir, prompt, 12, ignore_eos=True)
    if os.geteuid() == 0:  # root may always leave SCHED_IDLE, so helpers are idled here
        assert lent_policies == ([os.SCHED_OTHER], [os.SCHED_IDLE])
    assert own_policies == ([], [])  # never bound a team: no helper to idle


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_own_cores_only_borrows_nothing(builtin_dir):
    """A timing that must describe the worker alone (a prefill worker's start-up rate,
    prefill_worker/prefill_engine.py measure_rate) runs its steps on the worker's own core even
    while the other core's owner is idle; outside the block the step borrows it again."""
    if build.load_or_none() is None:
        pytest.skip("no cpu kernels build here (threads cannot be bound)")
    own, other = (CORES[0],), (CORES[1],)
    path = create_core_table("tandem-cores-test")
    peer = CoreTable(path, other, own + other)
    before = torch.get_num_threads()

    def run():
        engine, seen = _pinned_engine(builtin_dir, own, other, path)
        runner = engine.runner
        peer.idle()
        with runner.own_cores_only():
            runner.profile_run(32, 1, 32)
            alone = (list(seen), runner.lent_steps, runner.borrowing)
        seen.clear()
        runner.profile_run(32, 1, 32)
        return alone, (seen, runner.lent_steps, runner.borrowing)

    try:
        with cf.ThreadPoolExecutor(1) as pool:
            alone, lent = pool.submit(run).result(timeout=300)
    finally:
        peer.close()
        os.unlink(path)
        torch.set_num_threads(before)
    assert alone == ([1], 0, False)
    assert lent == ([2], 1, True)
