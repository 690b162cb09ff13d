"""Structured outputs through the official `openai` SDK on random-weight checkpoints
(noise: only the grammar keeps the output valid): every json_schema answer parses and
validates, streamed and not, `parse()` with a pydantic model; regex, choice and
grammar extras; logit_bias; a spec the engine cannot compile is a 400 with its message.
The disaggregated path is in tests/cluster/test_structured_disagg.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

MODEL = "tandem-tiny-v1"

# Strings carry maxLength: a noise model closes a free string only by chance.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 8},
                                      "level": {"enum": ["low", "mid", "high"]}},
     "required": ["ok", "note", "level"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                             "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                            "required": ["id", "tag"], "additionalProperties": False}},
        "total": {"type": "integer", "minimum": 0, "maximum": 5000}},
     "required": ["items", "total"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "string", "maxLength": 6}}, "required": ["point", "label"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=130)
    role: Literal["admin", "user", "guest"]


@pytest.fixture(scope="module", params=["random", "llama"])
def server(request, random_dir, llama_dir):
    """Random-weight models: their output is noise, so only the grammar keeps it valid."""
    path = random_dir if request.param == "random" else llama_dir
    backend = EngineBackend(EngineConfig(
        model=str(path), cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=32),
        device=DeviceConfig(num_threads=1)))
    app = create_app(backend, Tokenizer.from_dir(path), RouterSettings(served_model_name=MODEL))
    with ServerThread(app) as s:
        s.backend = backend
        s.path = path
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def chat_json(client, i: int, stream: bool, content: str | None = None) -> tuple[str, str]:
    """(text, finish reason) of a chat request for SCHEMAS[i % 5], sampled with seed i."""
    content = content or f"Give me record number {i}."
    kw = dict(model=MODEL, messages=[{"role": "user", "content": content}],
              response_format=_schema_format(i % len(SCHEMAS)), max_tokens=300, temperature=1.0, seed=i)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_json_schema_answer_validates(client, stream):
    n = 50
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: chat_json(client, i, stream), range(n)))
    for i, (text, reason) in enumerate(answers):
        assert reason == "stop", (i, reason, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])


def test_json_object_and_completions_endpoint(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    # any object: the noise may still fill a free string past max_tokens, so only check the start
    assert r.choices[0].message.content.startswith("{")
    c = client.completions.create(model=MODEL, prompt="x =", max_tokens=200, temperature=0.8, seed=3,
                                  extra_body={"response_format": _schema_format(0)})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS[0])


def test_parse_with_a_pydantic_model(client):
    for seed in range(5):
        r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Who is it?"}],
                                          response_format=Person, temperature=1.0, seed=seed, max_tokens=200)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person), r.choices[0].message.content
        r2 = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "And now?"}],
                                                response_format=Person, temperature=1.0, seed=seed, max_tokens=200)
        assert isinstance(r2.choices[0].message.parsed, Person)


def test_regex_choice_and_grammar_extras(client):
    msg = [{"role": "user", "content": "answer"}]
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=msg, temperature=1.0, seed=seed, max_tokens=40,
                                           extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,5}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", r.choices[0].message.content)
        r = client.chat.completions.create(model=MODEL, messages=msg, temperature=1.0, seed=seed, max_tokens=40,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert r.choices[0].message.content in ("yes", "no", "maybe")
        grammar = 'start: "SELECT " col " FROM " tbl\ncol: "a" | "b" | "*"\ntbl: /[a-z]{1,4}/'
        r = client.chat.completions.create(model=MODEL, messages=msg, temperature=1.0, seed=seed, max_tokens=40,
                                           extra_body={"structured_outputs": {"grammar": grammar}})
        assert re.fullmatch(r"SELECT (a|b|\*) FROM [a-z]{1,4}", r.choices[0].message.content)


def test_greedy_constrained_is_deterministic(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "same"}], response_format=_schema_format(1),
              max_tokens=200, temperature=0)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    jsonschema.validate(json.loads(a), SCHEMAS[1])


def test_logit_bias(client, server):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0,
                                  logit_bias={"300": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [300] * 8, r.choices[0]
    base = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].token_ids
    banned = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                       logit_bias={str(base[0]): -100},
                                       extra_body={"return_token_ids": True}).choices[0].token_ids
    assert banned[0] != base[0]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"guided_regex": "(unclosed"}, "response_format", "unclosed"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "response_format", "missing_rule"),
    ({"structured_outputs": {"choice": []}}, "response_format", "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 300}}, "logit_bias", "[-100, 100]"),
])
def test_bad_specs_are_400_with_the_engines_message(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_dead_end_finishes_with_a_clear_reason_and_no_leak(client, server):
    # the regex allows "ab" or "ac"; banning "b", "c", "ab" and "ac" (stop ids, under
    # min_tokens) leaves nothing after "a"
    tok = Tokenizer.from_dir(server.path)
    b = [tok.backend.token_to_id(t) for t in ("b", "c", "ab", "ac")]
    assert None not in b
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                  extra_body={"guided_regex": "a[bc]", "min_tokens": 5, "stop_token_ids": b, "return_token_ids": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            r = client.completions.create(**kw)
            reason, text = r.choices[0].finish_reason, r.choices[0].text
        assert (reason, text) == ("grammar_dead_end", "a")
    sched = server.backend.aengine.engine.scheduler
    server.call(server.backend.aengine.call(sched.check_integrity))
    assert server.call(server.backend.aengine.call(lambda: sched.pool.num_free_blocks)) == sched.pool.num_blocks
