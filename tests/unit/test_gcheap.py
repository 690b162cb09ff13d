"""worker_runtime/gcheap.py: what a served process does to its start-up heap."""

from __future__ import annotations

import gc
import weakref

import pytest

from worker_runtime.gcheap import freeze_startup_heap

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen():
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()  # the test process's objects back in the collector's generations


def _garbage_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_freeze_collects_first_then_freezes_what_lives(unfrozen, monkeypatch):
    monkeypatch.delenv("TANDEM_GC_FREEZE", raising=False)
    dead = _garbage_cycle()  # unreachable, kept alive only by its cycle
    kept = _Node()
    n = freeze_startup_heap("test")
    assert dead() is None  # collected, not frozen for good
    # n is what it froze; a frozen object that dies since (in any thread of this process,
    # e.g. the asyncio or gRPC threads earlier tests left) leaves the permanent generation
    assert 0 < gc.get_freeze_count() <= n
    assert gc.is_tracked(kept) and all(o is not kept for o in gc.get_objects())  # in no generation now
    # what is made afterwards is collected as before
    later = _garbage_cycle()
    gc.collect()
    assert later() is None


def test_switched_off(unfrozen, monkeypatch):
    monkeypatch.setenv("TANDEM_GC_FREEZE", "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0
