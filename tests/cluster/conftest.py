"""Cluster-test fixtures: real worker processes (`python -m prefill_worker` /
`python -m decode_worker`) on 127.0.0.1, started and stopped by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.builtin import builtin_model_path
from worker_runtime.process import WorkerProc, spawn_worker


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

    yield _spawn
    for w in procs:
        w.stop()
