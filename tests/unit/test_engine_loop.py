"""EngineLoop (worker_runtime/loop.py): commands whose callers gave up are skipped, and
never kill the engine thread (a storm of client disconnects once did: setting the
result of a cancelled future raised InvalidStateError on the engine thread)."""

import asyncio
import threading
import time

import pytest

from worker_runtime.loop import EngineLoop

pytestmark = pytest.mark.unit


async def test_cancelled_commands_are_skipped_and_the_loop_stays_healthy():
    fatal: list[str] = []
    loop = EngineLoop(step=lambda: [], wait_s=lambda: None, on_results=lambda r: None, on_fatal=fatal.append)
    loop.start()
    try:
        release = threading.Event()
        ran: list[int] = []
        loop.post(lambda: release.wait(5))  # holds the engine thread
        for i in range(50):  # every caller gives up while the engine is busy
            with pytest.raises(asyncio.TimeoutError):
                await loop.call(ran.append, i, timeout=0.001)
        release.set()
        assert await loop.call(lambda: "alive", timeout=5) == "alive"
        assert loop.healthy and not fatal
        assert ran == []  # the abandoned commands did not run
    finally:
        loop.stop()


async def test_a_failing_command_reaches_its_caller_only():
    fatal: list[str] = []
    loop = EngineLoop(step=lambda: [], wait_s=lambda: None, on_results=lambda r: None, on_fatal=fatal.append)
    loop.start()
    try:
        with pytest.raises(ZeroDivisionError):
            await loop.call(lambda: 1 / 0, timeout=5)
        assert await loop.call(lambda: 2, timeout=5) == 2 and loop.healthy and not fatal
    finally:
        loop.stop()


async def test_steps_and_commands_run_in_inference_mode_and_a_failing_step_still_reports():
    """The engine thread holds inference mode for its life (ModelRunner.execute then skips
    entering it per step); a step that raises still reaches on_fatal and marks the loop
    unhealthy."""
    import torch

    seen: list[bool] = []
    fatal: list[str] = []
    steps = iter([[], ["x"]])

    def step():
        seen.append(torch.is_inference_mode_enabled())
        out = next(steps, None)
        if out is None:
            raise RuntimeError("boom")
        return out

    got: list[list] = []
    loop = EngineLoop(step=step, wait_s=lambda: 0.0, on_results=got.append, on_fatal=fatal.append)
    loop.start()
    try:
        # on_fatal runs on the engine thread, results reach the event loop by call_soon:
        # the failure can be seen before the step's results are, so wait for both
        for _ in range(500):
            if fatal and got:
                break
            await asyncio.sleep(0.01)
        assert seen and all(seen), seen
        assert got == [["x"]]
        assert fatal and "RuntimeError: boom" in fatal[0] and not loop.healthy
        assert not torch.is_inference_mode_enabled()  # this thread's mode is untouched
    finally:
        loop.stop()


async def test_held_results_go_at_the_next_steps_flush_in_order_and_none_stay_behind():
    """hold_results (a CPU decode worker's): a step's results reach the event loop when the
    next step calls flush() (as the runner does before its layers), before that step's own;
    a step that never flushes hands the held ones over as it ends, ahead of its own; and when
    no step follows (idle), they go at once: nothing waits for a step that may not come."""
    got: list[tuple[str, list]] = []
    loop = EngineLoop(step=None, wait_s=None, on_results=None, on_fatal=lambda m: None)
    marks: list[str] = []
    plan = iter([("s1", False), ("s2", True), ("s3", False), ("s4", False)])
    more = threading.Event()
    more.set()

    def step():
        name, flushes = next(plan, (None, False))
        if name is None:
            more.clear()
            return []
        if flushes:
            time.sleep(0.2)  # time enough for the event loop to take anything handed over
            marks.append(f"{name} ran with {[n for n, _ in got]} delivered")
            loop.flush()
            time.sleep(0.2)
            marks.append(f"{name} flushed: {[n for n, _ in got]} delivered")
        return [name]

    def wait_s():
        return 0.0 if more.is_set() else None

    delivered = asyncio.Event()

    def on_results(results):
        got.append((results[0], list(results)))
        if results == ["s4"]:
            delivered.set()

    loop._step, loop._wait_s, loop._on_results = step, wait_s, on_results
    loop.hold_results = True
    loop.start()
    try:
        await asyncio.wait_for(delivered.wait(), 5)  # s4 goes once the loop finds no more work
    finally:
        loop.stop()
    assert [r for _, r in got] == [["s1"], ["s2"], ["s3"], ["s4"]]  # each once, in order
    # s1 held while s2 ran, handed over at its flush
    assert marks == ["s2 ran with [] delivered", "s2 flushed: ['s1'] delivered"]
