"""The rest of the API surface applications use, on the built-in model: best_of ranks
its candidates by cumulative logprob (checked against the same seeded candidates
asked for with n), /tokenize and /detokenize in vLLM's shapes, prompt_logprobs equal
to transformers' log-softmax over the prompt, and `user` / `metadata` accepted."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
import torch

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MODEL = "tandem-tiny-v2"


@pytest.fixture(scope="module")
def tok(builtin_dir) -> Tokenizer:
    return Tokenizer.from_dir(builtin_dir)


@pytest.fixture(scope="module")
def server(builtin_dir, tok):
    backend = EngineBackend(EngineConfig(
        model=str(builtin_dir), cache=CacheConfig(num_blocks=256, block_size=16),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=64),
        device=DeviceConfig(num_threads=1)))
    with ServerThread(create_app(backend, tok, RouterSettings(served_model_name=MODEL))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_best_of_returns_the_most_likely_candidates(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=77)
    cands = client.completions.create(n=5, logprobs=0, **kw).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in cands}
    ranked = sorted(score, key=lambda t: -score[t])
    best = client.completions.create(n=2, best_of=5, **kw)
    assert [c.text for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None  # not asked for: not shown
    assert best.usage.completion_tokens == 5 * 12  # every candidate's tokens count
    with_lp = client.completions.create(n=1, best_of=5, logprobs=1, **kw).choices[0]
    assert with_lp.text == ranked[0] and len(with_lp.logprobs.top_logprobs) == 12


@pytest.mark.parametrize("body, param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 99}, "best_of"),
])
def test_bad_best_of(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_and_detokenize(server, tok):
    text = "The quick brown fox"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == [tok.backend.id_to_token(i) for i in r["tokens"]]
    bare = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and "token_strs" not in bare
    msgs = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)}
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        bad = httpx.post(server.url + path, json=body)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text


def test_version_and_build_info(server):
    """vLLM's /version (with the commit where known) and tandem:build_info on /metrics."""
    from engine.build_info import build_info

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == build_info() and r.json()["version"] == "0.1.0"
    line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines() if x.startswith("tandem:build_info{"))
    assert 'component="router"' in line and 'version="0.1.0"' in line and line.endswith(" 1.0")


def test_user_and_metadata_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, user="user-1234", metadata={"team": "search"},
                                       temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@functools.lru_cache(maxsize=1)
def _hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_prompt_logprobs(path, ids):
    with torch.no_grad():
        logits = _hf(str(path))(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_prompt_logprobs_equal_transformers(client, server, tok, builtin_dir):
    from tests.oracle import random_prompts

    [ids] = random_prompts([150], seed=5)  # three chunks of 64
    hf = _hf_prompt_logprobs(builtin_dir, ids)
    for attempt in range(2):  # the second time the prompt is cached: still every position
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            own = entry[str(ids[i])]
            assert abs(own["logprob"] - hf[i - 1, ids[i]].item()) < 1e-3, (attempt, i)
            # the rank, up to tokens within float noise of this one (deep in the tail of a
            # trained model's distribution, hundreds of logprobs lie within 1e-3 of each other)
            chosen, row = hf[i - 1, ids[i]], hf[i - 1]
            assert int((row > chosen + 1e-4).sum()) + 1 <= own["rank"] <= int((row > chosen - 1e-4).sum()) + 1
            assert own["decoded_token"] == tok.backend.id_to_token(ids[i]) or own["decoded_token"]
            top = torch.topk(hf[i - 1], 3).indices.tolist()
            assert set(map(int, entry)) == set(top) | {ids[i]}
    # chat carries them at the top level; a stream in its first chunk
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": msgs, "max_tokens": 1, "prompt_logprobs": 0}).json()
    n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    assert len(chat["prompt_logprobs"]) == n and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3, stream=True,
                                            extra_body={"prompt_logprobs": 1}))
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert firsts[0] is not None and len(firsts[0]) == len(tok.encode("The quick brown fox"))
    assert all(f is None for f in firsts[1:])
    bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_add_special_tokens_false_encodes_a_completion_prompt_without_bos(client, tok, builtin_dir):
    """vLLM's `add_special_tokens` on completions: false sends the text's ids alone, and
    the greedy answer is transformers' on those ids."""
    from tests.oracle import hf_greedy

    text = "The sea was calm and the"
    bare, full = tok.encode(text, add_special_tokens=False), tok.encode(text)
    assert len(full) == len(bare) + 1  # the built-in tokenizer writes bos
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0,
                                  extra_body={"add_special_tokens": False, "return_token_ids": True})
    assert r.usage.prompt_tokens == len(bare)
    assert r.choices[0].prompt_token_ids == bare and r.choices[0].token_ids == hf_greedy(builtin_dir, bare, 6)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(full)
