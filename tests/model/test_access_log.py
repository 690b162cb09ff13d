"""The access log and request ids over a real socket on the built-in model: one line
per request with method, path, status, prompt and output tokens, TTFT, duration and
request id, in text and in JSON; the client's X-Request-Id echoed and carried into the
response id (and so into every engine request id a worker logs)."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from decode_worker.llm_engine import EngineConfig
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.tokenizer import Tokenizer
from router.app import RouterSettings, create_app
from tests.harness.engine_backend import EngineBackend
from tests.harness.server_thread import ServerThread
from worker_runtime.logs import JsonFormatter, use_log_format

pytestmark = [pytest.mark.model, pytest.mark.timeout(240)]

MODEL = "tandem-tiny-v2"
TEXT_LINE = re.compile(r'^127\.0\.0\.1:\d+ "(?P<method>[A-Z]+) (?P<path>\S+)" (?P<status>\d{3}) '
                       r"prompt=(?P<prompt>\d+|-) output=(?P<output>\d+|-) ttft=(?P<ttft>[0-9.]+ms|-) "
                       r"duration=(?P<duration>[0-9.]+)ms id=(?P<id>[A-Za-z0-9._:-]+)$")


@pytest.fixture(scope="module")
def server(builtin_dir):
    backend = EngineBackend(EngineConfig(
        model=str(builtin_dir), cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=256), device=DeviceConfig(num_threads=1)))
    app = create_app(backend, Tokenizer.from_dir(builtin_dir), RouterSettings(served_model_name=MODEL))
    with ServerThread(app) as s:
        yield s


def access_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tandem.access"]


def wait_for_line(caplog, n: int) -> list[logging.LogRecord]:
    """The line is written once the last byte went out, a moment after the client read it."""
    import time

    for _ in range(200):
        if len(access_lines(caplog)) >= n:
            break
        time.sleep(0.01)
    return access_lines(caplog)


def test_one_line_per_request_in_text_with_the_right_fields(server, caplog):
    caplog.set_level(logging.DEBUG, logger="tandem.access")
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "trace-42"}, timeout=60,
                   json={"model": MODEL, "prompt": "The sea is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"].startswith("cmpl-trace-42-")  # engine ids (what workers log) carry it
    usage = r.json()["usage"]
    [rec] = wait_for_line(caplog, 1)
    m = TEXT_LINE.match(rec.getMessage())
    assert m, rec.getMessage()
    assert (m["method"], m["path"], m["status"], m["id"]) == ("POST", "/v1/completions", "200", "trace-42")
    assert int(m["prompt"]) == usage["prompt_tokens"] and int(m["output"]) == usage["completion_tokens"] == 5
    ttft, duration = float(m["ttft"][:-2]), float(m["duration"])
    assert 0 < ttft <= duration
    assert rec.levelno == logging.INFO

    # streamed chat, no id given: a fresh one, echoed; the line comes after the stream's end
    caplog.clear()
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7,
                            "stream": True, "ignore_eos": True}) as s:
        rid = s.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{16}", rid)
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["id"] == f"chatcmpl-{rid}"
    [rec] = wait_for_line(caplog, 1)
    m = TEXT_LINE.match(rec.getMessage())
    assert m and m["id"] == rid and m["output"] == "7" and int(m["prompt"]) > 0 and m["ttft"] != "-"

    # a bad request: its status, no tokens; a client id with odd characters is replaced
    caplog.clear()
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "a b\tc"}, timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and re.fullmatch(r"[0-9a-f]{16}", r.headers["x-request-id"])
    [rec] = wait_for_line(caplog, 1)
    m = TEXT_LINE.match(rec.getMessage())
    assert m and (m["status"], m["prompt"], m["output"], m["ttft"]) == ("400", "-", "-", "-")

    # probes and scrapes at DEBUG only
    caplog.clear()
    assert httpx.get(server.url + "/health").status_code == 200
    [rec] = wait_for_line(caplog, 1)
    assert rec.levelno == logging.DEBUG and TEXT_LINE.match(rec.getMessage())["path"] == "/health"


def test_json_format_has_the_fields_as_keys(server, caplog):
    caplog.set_level(logging.INFO, logger="tandem.access")
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "json-7"}, timeout=60,
                   json={"model": MODEL, "prompt": "Once upon", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    [rec] = wait_for_line(caplog, 1)
    out = json.loads(JsonFormatter().format(rec))
    assert {k: out[k] for k in ("logger", "level", "method", "path", "status", "request_id")} == {
        "logger": "tandem.access", "level": "INFO", "method": "POST", "path": "/v1/completions", "status": 200,
        "request_id": "json-7"}
    assert out["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and out["output_tokens"] == 3
    assert 0 < out["ttft_ms"] <= out["duration_ms"] and out["message"] and out["time"]
    # --log-format json sets it on the (root) logger's handlers: every line is one object
    import io

    lg, out = logging.getLogger("tandem-test-json"), io.StringIO()
    lg.addHandler(logging.StreamHandler(out))
    lg.propagate = False
    use_log_format("json", "%(message)s", lg)
    lg.warning("one %s", "line", extra={"access": {"status": 204}})
    assert json.loads(out.getvalue()) | {"time": None} == {
        "time": None, "level": "WARNING", "logger": "tandem-test-json", "message": "one line", "status": 204}
    with pytest.raises(ValueError):
        use_log_format("yaml", "%(message)s", lg)


def test_a_client_gone_before_its_body_arrived_is_a_499_not_an_error(server, caplog):
    import socket

    caplog.set_level(logging.INFO)
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\"")
    s.close()
    [rec] = wait_for_line(caplog, 1)
    assert TEXT_LINE.match(rec.getMessage())["status"] == "499", rec.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_stream_the_client_cut_says_so(server, caplog):
    """Its status is the 200 that started the stream, so the line says the client closed
    it: a cut stream is not read as a complete answer."""
    caplog.set_level(logging.INFO, logger="tandem.access")
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "cut-1"}, timeout=60,
                      json={"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first token came
    [rec] = wait_for_line(caplog, 1)
    msg = rec.getMessage()
    assert msg.endswith(" client_closed") and TEXT_LINE.match(msg.removesuffix(" client_closed"))["status"] == "200"
    assert json.loads(JsonFormatter().format(rec))["client_closed"] is True
    # a complete stream's line has no such mark
    caplog.clear()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once", "max_tokens": 3, "stream": True}) as s:
        assert [line for line in s.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    [rec] = wait_for_line(caplog, 1)
    assert TEXT_LINE.match(rec.getMessage()) and "client_closed" not in json.loads(JsonFormatter().format(rec))

