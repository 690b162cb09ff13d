"""Structured outputs on a disaggregated `tandem serve` (a prefill and a decode worker,
Ray actors): the first token is sampled under the grammar on the prefill worker, the
rest on the decode worker, which replays it into its own matcher. Every answer of the
official `openai` SDK validates against its schema, streamed and not, and `parse()`
gives the pydantic model; the router's metrics show the prompts were prefilled remotely."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from engine.models.writer import random_model_path
from tests.cluster.test_serve import Serve
from tests.model.test_structured_outputs import SCHEMAS, Person, chat_json

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

MODEL = "tandem-tiny-v1"
WORDS = ("harbor lantern quiet meadow copper violet engine river orchard signal basket thunder "
         "pepper glacier candle museum rabbit socket tower window").split()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # the random-weight model: its output is noise, so only the grammar keeps it valid
    s = Serve(["--prefill", "1", "--decode", "1", "--max-model-len", "1024", "--model", str(random_model_path())],
              tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield s
    finally:
        s.stop()


def _long_prompt(i: int) -> str:
    """A unique opening and over 64 tokens: prefilled on the prefill worker, never from
    the decode worker's cache (router/policy.py local_prefill_threshold)."""
    body = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(60))
    return f"Request {i} ({i * 7919 % 1000}): {body}. Now give me the record."


def _decisions(srv, **labels: str) -> float:
    """tandem:prefill_decisions_total summed over the series with these labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tandem:prefill_decisions_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def _remote_count(srv) -> float:
    return _decisions(srv, where="remote")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_answers_validate_across_the_handoff(srv, stream):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _remote_count(srv)
    n = 50

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat_json(client, i, stream, _long_prompt(i + (100 if stream else 0))),
                                range(n)))
    for i, (text, reason) in enumerate(answers):
        assert reason == "stop", (i, reason, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    assert _remote_count(srv) - before >= n  # every one crossed the handoff


def test_parse_with_a_pydantic_model_across_the_handoff(srv):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _remote_count(srv)
    for seed in range(4):
        r = client.beta.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": _long_prompt(500 + seed)}],
            response_format=Person, temperature=1.0, seed=seed, max_tokens=200)
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content
    assert _remote_count(srv) - before >= 4


def test_prompt_logprobs_prefill_where_the_request_decodes(srv):
    import httpx
    import torch
    import transformers

    model_path = random_model_path()

    from tests.oracle import random_prompts

    [ids] = random_prompts([120], seed=41)
    before = _decisions(srv, reason="prompt_logprobs")
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)(
            torch.tensor([ids])).logits[0].log_softmax(-1)
    assert plp[0] is None and len(plp) == len(ids)
    assert all(abs(plp[i][str(ids[i])]["logprob"] - hf[i - 1, ids[i]].item()) < 1e-3 for i in range(1, len(ids)))
    assert _decisions(srv, reason="prompt_logprobs") == before + 1


def test_a_grammar_dead_end_on_the_prefill_worker(srv):
    """The first token has no allowed choice: the prefill worker sends the dead end
    across, the decode worker finishes the request with it, nothing leaks."""
    from openai import OpenAI

    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(random_model_path())
    banned = [tok.backend.token_to_id(t) for t in ("a", "b", "ab")]
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _remote_count(srv)
    r = client.completions.create(model=MODEL, prompt=_long_prompt(900), max_tokens=5, temperature=0,
                                  extra_body={"guided_regex": "ab?", "min_tokens": 3, "stop_token_ids": banned})
    assert (r.choices[0].finish_reason, r.choices[0].text) == ("grammar_dead_end", "")
    assert _remote_count(srv) == before + 1
