"""Tool calling through the official `openai` SDK on the random-weight built-in model
(served with the hermes template and parser): under tool_choice "required" and a named
function the grammar makes every call's arguments validate against its function's
schema, streamed and not; parallel_tool_calls=false gives one call; "auto" renders
the tools into the prompt; a conversation with tool results is accepted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from router.tools import chat_template_text
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

MODEL = "tandem-tiny-v1"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"room": {"type": "integer", "minimum": 1, "maximum": 40},
                                         "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "guest": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}},
        "required": ["room", "nights", "guest"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_room", "description": "Book a hotel room",
                                           "parameters": BOOK}}]
SCHEMA = {"get_weather": WEATHER, "book_room": BOOK}


@pytest.fixture(scope="module")
def server(random_dir):
    backend = EngineBackend(EngineConfig(
        model=str(random_dir), cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=32),
        device=DeviceConfig(num_threads=1)))
    tok = Tokenizer.from_dir(random_dir)
    tok.chat_template = chat_template_text("hermes")
    app = create_app(backend, tok, RouterSettings(served_model_name=MODEL, tool_call_parser="hermes"))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, i: int, choice, stream: bool, parallel: bool | None = None):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Task {i}: weather or a room?"}], tools=TOOLS,
              tool_choice=choice, temperature=1.0, seed=i, max_tokens=400)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], r.choices[0].finish_reason
    calls: dict[int, list] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, [None, None, ""])
                slot[0] = d.id or slot[0]
                slot[1] = (d.function.name if d.function else None) or slot[1]
                slot[2] += (d.function.arguments if d.function else None) or ""
    return [tuple(calls[i]) for i in sorted(calls)], reason


def _check(calls, reason, want_reason, names=None):
    assert reason == want_reason and calls, (reason, calls)
    for cid, name, args in calls:
        assert cid.startswith("call_") and (names is None or name in names)
        jsonschema.validate(json.loads(args), SCHEMA[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_calls_always_validate(client, stream):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(client, i, "required", stream), range(20)))
    for calls, reason in answers:
        _check(calls, reason, "tool_calls")
    assert {name for calls, _ in answers for _, name, _ in calls} == set(SCHEMA)  # both functions chosen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_function_calls_always_validate(client, stream):
    choice = {"type": "function", "function": {"name": "book_room"}}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(client, i, choice, stream), range(12)))
    for calls, reason in answers:
        _check(calls, reason, "stop", {"book_room"})
        assert len(calls) == 1


def test_parallel_tool_calls_false_gives_one_call(client):
    for i in range(6):
        calls, reason = _ask(client, i, "required", False, parallel=False)
        _check(calls, reason, "tool_calls")
        assert len(calls) == 1


def test_sdk_pydantic_function_tool_parses(client):
    class GetWeather(BaseModel):
        city: str = Field(max_length=10)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[tool],
                                      tool_choice="required", temperature=1.0, seed=3, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_auto_renders_the_tools_and_answers(client):
    msgs = [{"role": "user", "content": "hello"}]
    with_tools = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8,
                                          temperature=0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50
    assert none.usage.prompt_tokens == without.usage.prompt_tokens  # "none": the template does not see them
    assert none.choices[0].message.content == without.choices[0].message.content
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_conversation_with_tool_results(client):
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_abc", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_abc", "content": "light rain, 9 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=5,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 20


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_tool_requests_are_400(server, body, param):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
