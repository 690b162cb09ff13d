"""Cluster-test fixtures: real worker processes (`python -m prefill_worker` /
`python -m decode_worker`) on 127.0.0.1, started and stopped by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.builtin import builtin_model_path
from worker_runtime.process import WorkerProc, spawn_worker, start_worker


@pytest.fixture(scope="session")
def model_path() -> Path:
    return builtin_model_path()  # built once, before workers race to build it


@pytest.fixture
def spawn(tmp_path, model_path):
    """spawn(role, worker_id, **kw) -> WorkerProc; every process is stopped at teardown."""
    procs: list[WorkerProc] = []

    def _spawn(role: str, worker_id: str, **kw) -> WorkerProc:
        w = spawn_worker(role, worker_id, tmp_path, **kw)
        procs.append(w)
        return w

    def _together(*specs: tuple[str, str, dict]) -> list[WorkerProc]:
        """Several workers at once, each (role, worker_id, kw): their starts overlap."""
        starting = [start_worker(role, worker_id, tmp_path, **kw) for role, worker_id, kw in specs]
        ready = []
        try:
            for s in starting:
                ready.append(s.ready())
        finally:
            procs.extend(ready)
            for s in starting[len(ready):]:
                s.proc.kill()
        return ready

    _spawn.together = _together
    yield _spawn
    for w in procs:
        w.stop()


@pytest.fixture
def serve(tmp_path, model_path):
    """serve(*args) -> a ready `tandem serve` (tests/cluster/test_serve.py Serve); all stopped at teardown."""
    from tests.cluster.test_serve import Serve

    started: list[Serve] = []

    def _start(*args: str) -> Serve:
        s = Serve(list(args), tmp_path / f"serve-{len(started)}.log")
        started.append(s)
        return s

    yield _start
    for s in started:
        died = s.proc.poll() if s.proc is not None else None  # None too once a test stopped it
        s.stop()
        if died is not None:  # it exited before the test stopped it: show why (in the failure report)
            print(f"tandem serve exited by itself with {died}; the end of its log:")
            print("".join(open(s.log_path).readlines()[-60:]))
