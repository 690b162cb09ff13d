"""The OpenAI API over a real socket, driven by the official `openai` SDK, on the
built-in model through EngineBackend: greedy outputs equal transformers', streaming,
n with seeds, stop strings, usage (cached tokens), logprobs, and client disconnects
aborting the engine request."""

from __future__ import annotations

import functools
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(240)]

KEY = "sk-test-openai"
MODEL = "tandem-tiny-v2"
MAX_MODEL_LEN = 2048
CLEAN_PROMPT = "The quick brown fox"
ASCII_PROMPT = "Once upon a time"  # its first greedy tokens are plain ASCII


@pytest.fixture(scope="module")
def tok(builtin_dir) -> Tokenizer:
    return Tokenizer.from_dir(builtin_dir)


@pytest.fixture(scope="module")
def server(builtin_dir, tok):
    backend = EngineBackend(
        EngineConfig(
            model=str(builtin_dir),
            cache=CacheConfig(num_blocks=256),
            scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256),
            device=DeviceConfig(num_threads=1),
        )
    )
    app = create_app(backend, tok, RouterSettings(served_model_name=MODEL, api_keys=frozenset({KEY})))
    with ServerThread(app) as s:
        s.backend = backend
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@functools.lru_cache(maxsize=1)
def _hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def _hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    # An explicit attention mask: the built-in bos id is 0, and generate() would mask
    # every token equal to pad_token_id (tests.oracle.hf_greedy does, dropping the bos).
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_model(path).generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return tuple(out[0, len(prompt) :].tolist())


def greedy_text(tok, builtin_dir, ids, n) -> tuple[list[int], str]:
    """transformers' greedy continuation of `ids` (token ids, text)."""
    out = list(_hf_greedy(str(builtin_dir), tuple(ids), n))
    return out, tok.decode(out)


def engine_load(server) -> tuple[int, int]:
    sched = server.backend.aengine.engine.scheduler
    return server.call(server.backend.aengine.call(lambda: (len(sched.running), sched.num_waiting)))


def wait_idle(server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine_load(server) != (0, 0):
        assert time.monotonic() < deadline, f"engine still busy: {engine_load(server)}"
        time.sleep(0.05)
    engine = server.backend.aengine.engine
    server.call(server.backend.aengine.call(engine.check_integrity))


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_equals_transformers(client, tok, builtin_dir):
    ids = tok.encode(CLEAN_PROMPT)
    want_ids, want_text = greedy_text(tok, builtin_dir, ids, 16)
    r = client.completions.create(
        model=MODEL,
        prompt=CLEAN_PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.text == want_text and choice.finish_reason == "length"
    assert choice.token_ids == want_ids and choice.prompt_token_ids == ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 16, len(ids) + 16)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    # the same prompt as token ids
    r2 = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r2.choices[0].text == want_text


def test_completion_stream_equals_transformers(client, tok, builtin_dir):
    ids = tok.encode("Once upon a time")
    _, want_text = greedy_text(tok, builtin_dir, ids, 20)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    running = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == 20 and all(c.usage.prompt_tokens == len(ids) for c in running)


def test_batch_prompts_with_n(client, tok, builtin_dir):
    prompts = ["Hello world", CLEAN_PROMPT]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == greedy_text(tok, builtin_dir, tok.encode(prompts[c.index // 2]), 6)[1]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 6


def test_echo(client, tok, builtin_dir):
    _, want = greedy_text(tok, builtin_dir, tok.encode(CLEAN_PROMPT), 4)
    r = client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == CLEAN_PROMPT + want
    chunks = list(
        client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == CLEAN_PROMPT + want


def test_chat_greedy_equals_transformers(client, tok, builtin_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    _, want_text = greedy_text(tok, builtin_dir, ids, 12)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert r.choices[0].message.content == want_text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)
    # list-of-text-parts content renders like the plain string
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == want_text


def test_chat_stream(client, tok, builtin_dir):
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    _, want_text = greedy_text(tok, builtin_dir, ids, 10)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 10


def test_n_with_seed_uses_seed_plus_i(client):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True})
    both = client.completions.create(n=2, seed=7, **kw)
    again = client.completions.create(n=2, seed=7, **kw)
    assert [c.token_ids for c in both.choices] == [c.token_ids for c in again.choices]
    assert [c.index for c in both.choices] == [0, 1]
    solo = [client.completions.create(seed=s, **kw).choices[0].token_ids for s in (7, 8)]
    assert [c.token_ids for c in both.choices] == solo
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, seed=3, max_tokens=4, temperature=0
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_stop_string_ends_the_request(client, server, tok, builtin_dir):
    ids, full = greedy_text(tok, builtin_dir, tok.encode(CLEAN_PROMPT), 24)
    stop = tok.decode(ids[10:12])  # what the model writes after a few lines
    assert stop.strip() and stop in full
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=200, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=CLEAN_PROMPT, max_tokens=200, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL,
        prompt=CLEAN_PROMPT,
        max_tokens=200,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].text == want + stop
    wait_idle(server)  # the engine requests were aborted at the stop string


def test_cached_tokens_on_a_repeated_prompt(client, tok):
    prompt = " ".join(f"word{i}" for i in range(60))
    n = len(tok.encode(prompt))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0  # whole blocks of 16 tokens


def test_completion_logprobs_shape(client, tok, builtin_dir):
    assert greedy_text(tok, builtin_dir, tok.encode(ASCII_PROMPT), 5)[1].isascii()
    r = client.completions.create(model=MODEL, prompt=ASCII_PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)  # greedy
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ASCII_PROMPT, max_tokens=5, temperature=0, logprobs=1, stream=True
        )
    )
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def counters(server) -> dict[str, float]:
    """Aborted engine requests and generated tokens so far, from /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    aborted = sum(
        s.value
        for s in families["tandem:request_success"].samples
        if s.name.endswith("_total") and s.labels["finished_reason"] == "abort"
    )
    generated = sum(s.value for s in families["tandem:generation_tokens"].samples if s.name.endswith("_total"))
    return {"aborted": aborted, "generated": generated}


LONG = 2000  # tokens: far more than a disconnect leaves time for


def test_stream_disconnect_aborts_the_engine_request(server):
    before = counters(server)
    body = {"model": MODEL, "prompt": CLEAN_PROMPT, "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for _, line in zip(range(6), lines)]
            assert any(line.startswith("data: {") for line in got)
            assert engine_load(server)[0] == 1
        # leaving the block closes the connection mid-stream
    wait_idle(server)
    after = counters(server)
    assert after["aborted"] == before["aborted"] + 1
    assert after["generated"] - before["generated"] < LONG


def test_non_stream_disconnect_aborts_the_engine_request(server):
    before = counters(server)
    body = {"model": MODEL, "prompt": CLEAN_PROMPT, "max_tokens": LONG, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5) as http:
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/completions", json=body)
    wait_idle(server)
    after = counters(server)
    assert after["aborted"] == before["aborted"] + 1
    assert after["generated"] - before["generated"] < LONG
