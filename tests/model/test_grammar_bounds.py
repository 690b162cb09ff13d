"""A structured-output spec is bounded: one larger than --max-grammar-bytes is a 400
naming the limit before anything compiles it, and a compile runs on a thread of its
own, so the router's event loop (streams, /health) never waits for one, and one slower
than --grammar-compile-timeout-s is a 400 naming that. Both are counted in /metrics.
(Before: a 100,000-option choice list compiled on the event loop for tens of seconds,
/health took up to 9.9 s meanwhile, and the decode worker then panicked inside the
grammar engine.)"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, GrammarLimits, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MAX_BYTES = 4 << 20
TIMEOUT_S = 0.5


def choices(n: int) -> dict:
    return {"structured_outputs": {"choice": [f"option number {i} of a long list" for i in range(n)]}}


@pytest.fixture(scope="module")
def server(random_dir):
    backend = EngineBackend(EngineConfig(
        model=str(random_dir), cache=CacheConfig(num_blocks=128), grammar=GrammarLimits(MAX_BYTES),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8),
        device=DeviceConfig(num_threads=1)))
    settings = RouterSettings(served_model_name="m", max_grammar_bytes=MAX_BYTES, grammar_compile_timeout_s=TIMEOUT_S)
    with ServerThread(create_app(backend, Tokenizer.from_dir(random_dir), settings)) as s:
        yield s


def failures(server, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines()
                if x.startswith("tandem:grammar_compile_failures_total{") and f'reason="{reason}"' in x)
    return float(line.rsplit(" ", 1)[1])


def complete(server, extra: dict) -> httpx.Response:
    body = {"model": "m", "prompt": "pick one:", "max_tokens": 24, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_a_spec_over_the_byte_limit_is_refused_before_any_compile(server):
    before = failures(server, "too_large")
    spec = choices(130_000)  # about 4.9 MB of options, in a body under the 8 MiB limit
    assert len(json.dumps(spec)) > MAX_BYTES
    t0 = time.monotonic()
    r = complete(server, spec)
    assert r.status_code == 400 and time.monotonic() - t0 < 5.0
    err = r.json()["error"]
    assert err["param"] == "response_format" and "--max-grammar-bytes" in err["message"]
    assert str(MAX_BYTES) in err["message"] and "Traceback" not in r.text and "panicked" not in r.text
    assert failures(server, "too_large") == before + 1


def test_a_slow_compile_holds_up_nothing_and_ends_at_its_timeout(server):
    """60,000 options (2.3 MB) take about 5 s to compile on a 2-core Xeon: past the 0.5 s
    bound here; /health answers within 0.25 s all the while."""
    before = failures(server, "timeout")
    worst, done = [0.0], threading.Event()

    def poll_health():
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        r = complete(server, choices(60_000))
    finally:
        done.set()
        poller.join(30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--grammar-compile-timeout-s" in err["message"] and err["param"] == "response_format"
    assert failures(server, "timeout") == before + 1
    assert worst[0] < 0.25, f"/health took {worst[0]:.3f} s while a grammar compiled"
    # a small spec right after still compiles (the one grammar thread is not wedged for long)
    deadline = time.monotonic() + 30
    while (r := complete(server, choices(3))).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["choices"][0]["text"] in {f"option number {i} of a long list" for i in range(3)}


def test_a_worker_bounds_its_own_compile(random_dir):
    """A worker does not rely on the router's bound (a router with other settings may
    send it anything under the byte limit): its compile of a spec that takes too long
    ends at --grammar-compile-timeout-s as a SamplingParamsError (INVALID_ARGUMENT, a
    400 that is not retried), and the worker's grammar thread then serves the next one."""
    import asyncio

    from engine.sampling_params import SamplingParams, SamplingParamsError
    from engine.structured import GuidedSpec, StructuredOutputs
    from worker_runtime.grammar import matcher_for

    limits = GrammarLimits(MAX_BYTES, compile_timeout_s=TIMEOUT_S)
    structured = StructuredOutputs.for_checkpoint(random_dir, [1, 4], limits)
    slow = SamplingParams(guided=GuidedSpec("choice", json.dumps([f"option number {i} of a long list"
                                                                   for i in range(60_000)])))
    t0 = time.monotonic()
    with pytest.raises(SamplingParamsError, match="--grammar-compile-timeout-s") as e:
        asyncio.run(matcher_for(structured, slow))
    assert e.value.param == "response_format" and time.monotonic() - t0 < TIMEOUT_S + 1.0
    deadline = time.monotonic() + 30  # the abandoned compile ends in the background; then the next one runs
    small = SamplingParams(guided=GuidedSpec("choice", json.dumps(["yes", "no"])))
    while True:
        try:
            assert asyncio.run(matcher_for(structured, small)) is not None
            break
        except SamplingParamsError:
            assert time.monotonic() < deadline
