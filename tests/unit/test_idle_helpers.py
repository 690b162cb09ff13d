"""IdleHelpers (engine/cores.py): a bound OpenMP team's helpers that the next step does
not use wait at SCHED_IDLE, and come back to SCHED_OTHER when a step needs them. Real
libgomp threads, bound by the compiled kernels' bind_threads."""

import concurrent.futures as cf
import os
import threading

import pytest

from engine.cores import IdleHelpers

pytestmark = pytest.mark.unit

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")


def on_thread(fn):
    """Run fn on a thread of its own: bind_threads pins its caller, and the team (with its
    helper threads) belongs to that thread and goes when it ends."""
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=60)


def policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


@needs_two
def test_team_tids_name_the_bound_team_with_the_caller_first(cpu_ops):
    def run():
        got = list(cpu_ops.bind_threads(CORES[:2]))
        tids = list(cpu_ops.team_tids())
        return got, tids, threading.get_native_id(), [str(t) in os.listdir("/proc/self/task") for t in tids]

    got, tids, me, alive = on_thread(run)
    assert got == CORES[:2]
    assert len(tids) == 2 and tids[0] == me and tids[1] != me
    assert alive == [True, True]  # threads of this process


@needs_two
@pytest.mark.skipif(os.geteuid() != 0 and not IdleHelpers.available(), reason="SCHED_IDLE round trip not allowed")
def test_unused_helpers_wait_at_sched_idle_and_come_back(cpu_ops):
    assert IdleHelpers.available()

    def run():
        cpu_ops.bind_threads(CORES[:2])
        helpers = IdleHelpers()
        helpers.rebound(list(cpu_ops.team_tids())[1:])
        (tid,) = helpers.tids
        seen = [policy(tid)]
        helpers.use(0)  # a one-thread step, or an idle engine
        seen.append(policy(tid))
        helpers.use(0)  # no change: nothing to do
        seen.append(policy(tid))
        helpers.use(1)  # a two-thread step
        seen.append(policy(tid))
        helpers.use(0)
        helpers.rebound([tid])  # a new team reusing an idled thread: back to normal
        seen.append(policy(tid))
        return seen

    assert on_thread(run) == [os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_OTHER]


def test_where_a_thread_cannot_leave_sched_idle_helpers_are_never_idled(monkeypatch):
    calls = []

    def refuse_return(pid, pol, param):  # what an unprivileged thread meets with RLIMIT_NICE 0
        calls.append(pol)
        if pol != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse_return)
    assert IdleHelpers.available() is False
    assert calls == [os.SCHED_IDLE, os.SCHED_OTHER]


def test_a_failed_change_stops_idling_instead_of_retrying_every_step(monkeypatch, caplog):
    def gone(pid, pol, param):
        raise ProcessLookupError(3, "No such process")

    helpers = IdleHelpers()
    helpers.tids, helpers._idle = [123456789], [False]
    monkeypatch.setattr(os, "sched_setscheduler", gone)
    helpers.use(0)
    assert helpers.tids == [] and "no longer idled" in caplog.text
    helpers.use(0)  # nothing left to change
    assert caplog.text.count("no longer idled") == 1
