"""Every bad input of the OpenAI endpoints answers an OpenAI error object with the right
status (and `param`); API and admin keys; overload answers 429/503 with Retry-After
and recovers; /metrics parses and carries every router series."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from protos.tokens import TokenBatch
from router.admin import AdminInterface
from router.app import RouterSettings, create_app
from router.backend import Backend, BackendError
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.timeout(240)]

MODEL = "tandem-tiny-v2"
KEY, FILE_KEYS, ADMIN = "k-list", ("k-file-1", "k-file-2"), "k-admin"
MAX_MODEL_LEN = 256
ANY = object()


class FakePools(AdminInterface):
    def __init__(self) -> None:
        self.pools = {"prefill": 1, "decode": 1}

    async def get_pools(self) -> dict:
        return dict(self.pools)

    async def set_pools(self, prefill: int | None, decode: int | None) -> dict:
        if prefill is not None and prefill > 8:
            raise ValueError("at most 8 prefill workers")
        self.pools.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None})
        return dict(self.pools)


@pytest.fixture(scope="module")
def tok(builtin_dir) -> Tokenizer:
    return Tokenizer.from_dir(builtin_dir)


@pytest.fixture(scope="module")
def server(builtin_dir, tok, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# router keys\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  # ops team\n")
    backend = EngineBackend(
        EngineConfig(
            model=str(builtin_dir),
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256),
            device=DeviceConfig(num_threads=1),
        )
    )
    settings = RouterSettings(
        served_model_name=MODEL,
        model_aliases=(str(builtin_dir),),  # as `tandem serve` sets it: the checkpoint's path
        api_keys=frozenset({KEY}),
        api_key_file=str(key_file),
        admin_key=ADMIN,
        max_concurrent_requests=2,
        max_queued_requests=2,
        queue_timeout_s=0.5,
        max_n=4,
        max_request_body_bytes=64 * 1024,
    )
    with ServerThread(create_app(backend, tok, settings, admin=FakePools())) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def check_error(r: httpx.Response, status: int, param=ANY, code=ANY) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not ANY:
        assert err["param"] == param, err
    if code is not ANY:
        assert err["code"] == code, err
    return err


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}

BAD_FIELDS = [  # (fields merged into a valid request, param named in the error)
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"n": 5}, "n"),
    ({"n": "two"}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stream": "maybe"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"50": 500}}, "logit_bias"),
    ({"ignore_eos": "perhaps"}, "ignore_eos"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": [5, 99999]}, "stop_token_ids"),  # outside the vocabulary: it could never match
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    # vLLM extras that are not implemented are refused, not ignored
    ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"bad_words": ["sea"]}, "bad_words"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"use_beam_search": "no"}, "use_beam_search"),
    ({"priority": "high"}, "priority"),
]
BAD_COMPLETION = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True, 3]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": [[5], [-1]]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"suffix": "end"}, "suffix"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"add_special_tokens": [1]}, "add_special_tokens"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # the template has no tool role
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 5}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto needs a parser
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_special_tokens": True}, "add_special_tokens"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"documents": [{"text": "x"}]}, "documents"),
]


@pytest.mark.parametrize("fields,param", BAD_FIELDS + [(f, p) for f, p in BAD_COMPLETION])
def test_bad_completion_fields(http, fields, param):
    check_error(http.post("/v1/completions", json={**COMPLETION, **fields}), 400, param)


@pytest.mark.parametrize("fields,param", BAD_FIELDS + BAD_CHAT)
def test_bad_chat_fields(http, fields, param):
    check_error(http.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_bad_bodies(http, path):
    body = ENDPOINTS[path]
    check_error(http.post(path, content=b'{"model": "x",'), 400, None, "invalid_json")
    check_error(http.post(path, content=b""), 400, None, "invalid_json")
    check_error(http.post(path, content=b"\xff\xfe"), 400, None, "invalid_json")
    check_error(http.post(path, json=[body]), 400, None)
    required = "prompt" if "prompt" in body else "messages"
    check_error(http.post(path, json={k: v for k, v in body.items() if k != required}), 400, required)
    check_error(http.post(path, json={**body, "model": "gpt-5"}), 404, "model", "model_not_found")
    check_error(http.post(path, content=b" " * (64 * 1024 + 1)), 413, None, "request_too_large")
    assert http.post(path, json={k: v for k, v in body.items() if k != "model"}).status_code == 200  # model optional
    assert http.post(path, json={**body, "unknown_field": 1}).status_code == 200  # extras ignored
    # the unimplemented vLLM extras at the values that ask for nothing, as clients send them
    off = {"allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None, "use_beam_search": False,
           "length_penalty": 1.0, "logits_processors": None, "return_tokens_as_token_ids": False,
           "spaces_between_special_tokens": True}
    assert http.post(path, json={**body, **off}).status_code == 200
    # a top_k past the vocabulary (and past int32) keeps every token: an answer, not an error
    assert http.post(path, json={**body, "top_k": 10**12, "temperature": 0}).status_code == 200


def test_context_length(http, tok):
    words = " ".join(["tok"] * 300)
    assert len(tok.encode(words)) >= MAX_MODEL_LEN
    check_error(
        http.post("/v1/completions", json={**COMPLETION, "prompt": words}), 400, "prompt", "context_length_exceeded"
    )
    check_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [7] * MAX_MODEL_LEN}), 400, "prompt")
    chat = {**CHAT, "messages": [{"role": "user", "content": words}]}
    check_error(http.post("/v1/chat/completions", json=chat), 400, "messages", "context_length_exceeded")
    check_error(
        http.post("/v1/completions", json={**COMPLETION, "max_tokens": MAX_MODEL_LEN}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    check_error(
        http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 10_000}),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )
    # without max_tokens, chat takes the room left; the longest prompt that fits still runs
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": [7] * (MAX_MODEL_LEN - 1), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_routes_and_methods(http, builtin_dir):
    check_error(http.get("/v1/nothing-here"), 404, None, "not_found")
    check_error(http.post("/v2/completions", json=COMPLETION), 404)
    r = http.get("/v1/completions")
    check_error(r, 405, None, "method_not_allowed")
    assert "POST" in r.headers["allow"]
    check_error(http.put("/v1/chat/completions", json=CHAT), 405)
    check_error(http.get("/v1/models/gpt-5"), 404, "model", "model_not_found")
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    # the list names the served model only: the alias (a server path) is never shown
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    assert str(builtin_dir) not in http.get("/v1/models").text
    check_error(http.get(f"/v1/models/{builtin_dir}"), 404, "model", "model_not_found")


def test_api_keys(server):
    url = server.url + "/v1/chat/completions"
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {ADMIN}"},
    ):
        r = httpx.post(url, json=CHAT, headers=headers)
        check_error(r, 401, None, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    for key in (KEY, *FILE_KEYS):
        assert httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    check_error(httpx.get(server.url + "/v1/models"), 401)
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + open_path).status_code == 200


def test_admin_key(server):
    url = server.url + "/admin/pools"
    check_error(httpx.get(url), 401)
    check_error(httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}), 403)  # an API key is not enough
    admin = {"Authorization": f"Bearer {ADMIN}"}
    got = httpx.get(url, headers=admin).json()
    assert got.pop("drift")["drift"] is None  # the router adds its traffic drift; none judged yet
    assert got == {"prefill": 1, "decode": 1}
    check_error(httpx.post(url, json={"decode": 3}, headers={"Authorization": f"Bearer {KEY}"}), 403)
    assert httpx.post(url, json={"decode": 3}, headers=admin).json() == {"prefill": 1, "decode": 3}
    check_error(httpx.post(url, json={}, headers=admin), 400)
    check_error(httpx.post(url, json={"decode": -1}, headers=admin), 400, "decode")
    check_error(httpx.post(url, json={"prefill": 99}, headers=admin), 400)
    check_error(httpx.post(url, content=b"{", headers=admin), 400, None, "invalid_json")


class Idle(Backend):
    """A backend that is never ready (for apps whose routes never reach it)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, req):
        raise AssertionError("not reached")

    def ready(self) -> bool:
        return False

    @property
    def max_model_len(self) -> int:
        return 0


def test_admin_without_pools_or_key(tok):
    client = TestClient(create_app(Idle(), tok, RouterSettings(admin_key=ADMIN, manage_backend=False)))
    check_error(client.get("/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}), 501, None, "not_implemented")
    check_error(client.post("/admin/pools", json={"decode": 1}), 501)
    client = TestClient(create_app(Idle(), tok, RouterSettings(manage_backend=False), admin=FakePools()))
    check_error(client.get("/admin/pools", headers={"Authorization": "Bearer x"}), 403, None, "admin_disabled")
    r = client.get("/ready")
    check_error(r, 503, None, "not_ready")
    assert r.headers["retry-after"] == "1"
    check_error(client.post("/v1/completions", json=COMPLETION), 503)  # open (no keys), backend not ready
    assert client.get("/health").status_code == 200


class Scripted(Backend):
    """One token, then what max_tokens says: 2 a bug (RuntimeError), 3 a failed
    request, 4 a refusal for overload before any token."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def ready(self) -> bool:
        return True

    @property
    def max_model_len(self) -> int:
        return 64

    async def generate(self, req):
        if req.params.max_tokens == 4:
            raise BackendError("decode pool is full", 429, retry_after=2.5)
        yield TokenBatch(0, [300], prompt_tokens=len(req.prompt_ids), completion_tokens=1)
        if req.params.max_tokens == 2:
            raise RuntimeError("secret internals")
        yield TokenBatch(1, [], finished=True, finish_reason="error", error="decode worker died")


def test_backend_failures(tok):
    client = TestClient(
        create_app(Scripted(), tok, RouterSettings(manage_backend=False)), raise_server_exceptions=False
    )
    err = check_error(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2}), 500, None, "internal_error")
    assert "secret" not in err["message"] and "Traceback" not in err["message"]
    err = check_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}), 500, None, "internal_error")
    assert err["message"] == "decode worker died"
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 4})
    check_error(r, 429, None, "queue_full")
    assert r.headers["retry-after"] == "3"
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "decode worker died" in events[-2] and '"choices"' in events[0]
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and "internal_error" in events[-2] and "secret" not in r.text
    metrics = client.get("/metrics").text
    assert 'tandem:request_errors_total{model_name="tandem-tiny-v2",status="500"} 4.0' in metrics


async def test_overload_answers_429_or_503_then_recovers(server):
    body = {**COMPLETION, "max_tokens": 120, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        replies = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))
        statuses = [r.status_code for r in replies]
        assert set(statuses) <= {200, 429, 503} and statuses.count(200) >= 2, statuses
        busy = [r for r in replies if r.status_code != 200]
        assert len(busy) >= 12 - 4, statuses  # 2 running + 2 queued at most
        for r in busy:
            check_error(r, r.status_code)
            assert int(r.headers["retry-after"]) >= 1
        for _ in range(4):  # capacity is back
            assert (await c.post("/v1/completions", json=body)).status_code == 200
    samples = metric_samples(server)
    assert samples["tandem:router_num_requests_running"] == samples["tandem:router_num_requests_waiting"] == 0


def metric_samples(server) -> dict:
    """Samples by name (labels beyond model_name: (name, labels)), summed over the
    traffic classes; per class as (name, labels, class) too."""
    text = httpx.get(server.url + "/metrics").text
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "class"}
            key = s.name if set(labels) == {"model_name"} else (s.name, tuple(sorted(labels.items())))
            out[key] = out.get(key, 0) + s.value
            if "class" in s.labels:
                out[(s.name, tuple(sorted(labels.items())), s.labels["class"])] = s.value
    out["families"] = {f.name for f in text_string_to_metric_families(text)}
    return out


def test_metrics_carry_every_series(http, server):
    before = metric_samples(server)
    for _ in range(2):
        assert (
            http.post("/v1/completions", json={**COMPLETION, "prompt": "word " * 40, "max_tokens": 4}).status_code
            == 200
        )
    batch = http.post("/v1/completions", json={**COMPLETION, "prompt": "word " * 40, "max_tokens": 4, "priority": 3})
    assert batch.status_code == 200
    http.post("/v1/completions", json={**COMPLETION, "n": 99})  # one 400
    s = metric_samples(server)
    m = ("model_name", MODEL)
    assert s["families"] >= {
        "tandem:request_success",
        "tandem:router_num_requests_running",
        "tandem:router_num_requests_waiting",
        "tandem:prompt_tokens",
        "tandem:generation_tokens",
        "tandem:router_prefix_cache_queries",
        "tandem:router_prefix_cache_hits",
        "tandem:time_to_first_token_seconds",
        "tandem:inter_token_latency_seconds",
        "tandem:time_per_output_token_seconds",
        "tandem:request_time_per_output_token_seconds",
        "tandem:e2e_request_latency_seconds",
        "tandem:request_queue_time_seconds",
        "tandem:request_prefill_time_seconds",
        "tandem:request_decode_time_seconds",
        "tandem:request_inference_time_seconds",
        "tandem:request_prompt_tokens",
        "tandem:request_generation_tokens",
        "tandem:request_params_max_tokens",
        "tandem:request_errors",
        "tandem:slo_attainment",
        "tandem:goodput_tokens",
        "tandem:slo_ttft_seconds",
        "tandem:slo_tpot_seconds",
        "tandem:admission_queue_timeout_seconds",
        "tandem:admission_max_running",
        "tandem:admission_max_waiting",
    }
    assert s["tandem:admission_queue_timeout_seconds"] == 0.5  # the fixture's --queue-timeout-s
    assert s["tandem:admission_max_running"] == 2 and s["tandem:admission_max_waiting"] == 2
    assert s[("tandem:request_success_total", (("finished_reason", "length"), m))] >= 2
    assert s[("tandem:request_errors_total", (m, ("status", "400")))] >= 1
    assert s["tandem:prompt_tokens_total"] == s["tandem:router_prefix_cache_queries_total"] > 0
    assert 0 < s["tandem:router_prefix_cache_hits_total"] < s["tandem:router_prefix_cache_queries_total"]
    assert s["tandem:generation_tokens_total"] >= 8
    ttft_count = s["tandem:time_to_first_token_seconds_count"]
    assert ttft_count >= 2 and s["tandem:e2e_request_latency_seconds_count"] >= 2
    assert s["tandem:inter_token_latency_seconds_count"] >= 6
    assert s["tandem:time_per_output_token_seconds_count"] == s["tandem:inter_token_latency_seconds_count"]  # per token
    assert s["tandem:request_time_per_output_token_seconds_count"] >= 2  # per request
    done = s["tandem:e2e_request_latency_seconds_count"]
    for phase in ("queue", "prefill", "decode", "inference"):
        assert s[f"tandem:request_{phase}_time_seconds_count"] == done
    assert s["tandem:request_generation_tokens_sum"] == s["tandem:generation_tokens_total"]
    assert s["tandem:request_params_max_tokens_count"] == done
    met = (
        s[("tandem:slo_attainment_total", (("met", "true"), m))]
        + s[("tandem:slo_attainment_total", (("met", "false"), m))]
    )
    assert met == s["tandem:e2e_request_latency_seconds_count"]
    # the priority-3 request was judged as batch work, by the batch SLOs
    for cls, new in (("batch", 1), ("interactive", 2)):
        key = ("tandem:e2e_request_latency_seconds_count", (m,), cls)
        assert s[key] - before.get(key, 0) == new, cls
    assert s[("tandem:slo_ttft_seconds", (m,), "batch")] == 30.0
    assert s[("tandem:slo_ttft_seconds", (m,), "interactive")] == 1.0
    assert s[("tandem:goodput_tokens_total", (m,), "batch")] - before.get(
        ("tandem:goodput_tokens_total", (m,), "batch"), 0) == 4


async def test_megabyte_prompts_are_refused_before_tokenizing(builtin_dir, tok):
    """Four concurrent multi-megabyte prompts once held the router for tens of seconds
    and gigabytes (tokenized, then refused); now: 413 above the (lower) default body
    limit, and text that cannot fit the context is refused by its length alone, while
    a small request next to them is served."""
    backend = EngineBackend(EngineConfig(
        model=str(builtin_dir), cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256),
        device=DeviceConfig(num_threads=1)))
    settings = RouterSettings(served_model_name=MODEL)
    assert settings.max_request_body_bytes <= 8 * 1024 * 1024
    big = "lorem ipsum dolor sit amet " * (6_000_000 // 27)  # 6 MB: under the body limit
    with ServerThread(create_app(backend, tok, settings)) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            huge = await c.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 20_000_000})
            check_error(huge, 413, None, "request_too_large")
            replies = await asyncio.gather(
                *(c.post("/v1/completions", json={**COMPLETION, "prompt": big}) for _ in range(3)),
                c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": big}]}),
                c.post("/v1/completions", json={**COMPLETION, "prompt": ["fine", big]}),
                c.post("/v1/completions", json={**COMPLETION, "prompt": "a small one", "max_tokens": 4}),
            )
    for r, param in zip(replies[:5], ["prompt"] * 3 + ["messages", "prompt"]):
        err = check_error(r, 400, param, "context_length_exceeded")
        assert f"has {len(big)} characters" in err["message"], err["message"]
    assert replies[5].status_code == 200 and replies[5].json()["usage"]["completion_tokens"] == 4
