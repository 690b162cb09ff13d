"""The streaming client against a throw-away OpenAI-shaped SSE server (a test fixture on
127.0.0.1, random port, stopped by the fixture) that plays scripted streams: the
scenario is chosen by the request's `model` field."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time

import pytest
from aiohttp import web

from bench import cli
from bench.client import ClientConfig, StreamClient
from bench.metrics import itl_samples, tpot
from bench.records import RequestRecord
from bench.runner import RunConfig, timed_run
from bench.sse import SSEParser
from bench.workloads import RequestSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None  # plots are optional here

GAP = 0.03  # seconds between scripted token chunks
BODIES = web.AppKey("bodies", list)
SERVED = web.AppKey("served", set)


def _chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None,
           chat: bool = False, no_choices: bool = False) -> bytes:
    body: dict = {"id": "x", "object": "chunk", "choices": []}
    if not no_choices:
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        body["choices"] = [choice]
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


async def _stream(request: web.Request, parts: list[bytes], gap: float = GAP,
                  drop_after: int | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, part in enumerate(parts):
        if drop_after is not None and i == drop_after:
            request.transport.abort()  # the connection dies mid-stream
            return resp
        await resp.write(part)
        await asyncio.sleep(gap)
    return resp


def _usage(n_out: int, n_in: int = 7) -> dict:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    scenario = body["model"]
    request.app[BODIES].append(body)
    n = body["max_tokens"]
    tokens = [_chunk(f" t{i}") for i in range(n)]
    done = b"data: [DONE]\n\n"
    if scenario == "one_per_connection":  # like llama-server: a reused keep-alive dies
        conn = id(request.transport)
        if conn in request.app[SERVED]:
            request.transport.abort()
            return web.Response()
        request.app[SERVED].add(conn)
        return await _stream(request, [*tokens, done], gap=0.001)
    if scenario == "normal":  # usage-only last chunk, keep-alive comments in between
        parts = [b": ping\n\n", *tokens, _chunk("", finish="length"),
                 _chunk(usage=_usage(n), no_choices=True), done]
        return await _stream(request, parts)
    if scenario == "llamacpp":  # usage inside the final chunk that has choices; CRLF
        parts = [p.replace(b"\n", b"\r\n") for p in tokens]
        parts += [_chunk("", finish="length", usage=_usage(n)), done]
        return await _stream(request, parts)
    if scenario == "continuous":  # usage in every chunk: the 2nd chunk carries 2 tokens
        parts = [_chunk("a", usage=_usage(1)), _chunk("bc", usage=_usage(3)),
                 _chunk("d", usage=_usage(4)), _chunk("", "length", usage=_usage(4)), done]
        return await _stream(request, parts)
    if scenario == "no_usage":
        return await _stream(request, [*tokens, done])
    if scenario == "error500":
        return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
    if scenario == "drop":
        return await _stream(request, [*tokens, done], drop_after=2)
    if scenario == "error_event":
        err = b'data: {"error": {"message": "out of KV blocks"}}\n\n'
        return await _stream(request, [tokens[0], err, done])
    if scenario == "no_done":
        return await _stream(request, tokens[:2])
    if scenario == "slow":
        return await _stream(request, [*tokens, done], gap=5.0)
    raise web.HTTPBadRequest(text=f"unknown scenario {scenario}")


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    n = body["max_tokens"]
    first = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    parts = [first, *[_chunk(f"w{i}", chat=True) for i in range(n)],
             _chunk(None, finish="stop", chat=True),
             _chunk(usage=_usage(n), no_choices=True), b"data: [DONE]\n\n"]
    return await _stream(request, parts)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "normal"}]})


def make_app() -> web.Application:
    app = web.Application()
    app[BODIES] = []
    app[SERVED] = set()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def server():
    app = make_app()
    runner, url = await _start(app)
    try:
        yield url, app
    finally:
        await asyncio.wait_for(runner.cleanup(), timeout=10)


@pytest.fixture
def threaded_server():
    """The same server on its own loop in a thread, for the synchronous CLI."""
    loop = asyncio.new_event_loop()
    started, box = threading.Event(), {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner, box["url"] = loop.run_until_complete(_start(make_app()))
        started.set()
        loop.run_forever()
        loop.run_until_complete(asyncio.wait_for(runner.cleanup(), timeout=10))
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10), "test server did not start"
    yield box["url"]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(15)


async def _send(base_url: str, model: str, n: int = 4, endpoint: str = "completions",
                **cfg) -> RequestRecord:
    spec = RequestSpec("hello there" if endpoint == "chat" else [5, 6, 7], 3, n)
    async with StreamClient(ClientConfig(base_url, endpoint, model=model, **cfg)) as client:
        return await client.send(spec, RequestRecord(index=0), time.perf_counter())


async def test_normal_stream_with_pings_and_usage_only_chunk(server):
    url, app = server
    rec = await _send(url, "normal", n=4)
    assert rec.ok, rec.error
    assert rec.output_tokens == 4 and rec.output_tokens_source == "usage"
    assert rec.input_tokens == 7 and rec.input_tokens_source == "usage"
    assert rec.chunk_tokens == [1, 1, 1, 1]  # the empty finish chunk is no token
    assert rec.finish_reason == "length"
    gaps = itl_samples(rec)
    assert len(gaps) == 3 and all(0.5 * GAP < g < 5 * GAP for g in gaps)
    assert tpot(rec) == pytest.approx(sum(gaps) / 3)
    body = app[BODIES][0]
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == [5, 6, 7] and body["temperature"] == 0.0


async def test_llamacpp_usage_in_last_choice_chunk_and_crlf(server):
    rec = await _send(server[0], "llamacpp", n=3)
    assert rec.ok, rec.error
    assert (rec.output_tokens, rec.output_tokens_source) == (3, "usage")
    assert len(rec.chunk_times) == 3


async def test_continuous_usage_counts_tokens_per_chunk(server):
    rec = await _send(server[0], "continuous", continuous_usage=True)
    assert rec.ok, rec.error
    assert rec.chunk_tokens == [1, 2, 1] and rec.output_tokens == 4
    assert len(itl_samples(rec)) == 3  # output_tokens - 1 per-token gaps
    assert sum(itl_samples(rec)) == pytest.approx(rec.e2e - rec.ttft)


async def test_without_usage_tokens_are_counted_from_chunks(server):
    rec = await _send(server[0], "no_usage", n=5)
    assert rec.ok, rec.error
    assert (rec.output_tokens, rec.output_tokens_source) == (5, "chunks")
    assert (rec.input_tokens, rec.input_tokens_source) == (3, "spec")


async def test_chat_skips_role_only_delta(server):
    rec = await _send(server[0], "normal", n=3, endpoint="chat")
    assert rec.ok, rec.error
    assert len(rec.chunk_times) == 3 and rec.output_tokens == 3
    assert server[1][BODIES][0]["messages"] == [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("model, kind", [
    ("error500", "http_500: boom"), ("drop", "disconnected"),
    ("error_event", "stream_error: out of KV blocks"), ("no_done", "truncated")])
async def test_failures_are_captured_with_reasons(server, model, kind):
    rec = await _send(server[0], model, n=5)
    assert not rec.ok and rec.error.startswith(kind), rec.error
    assert rec.ttft is None and tpot(rec) is None


async def test_timeout_is_a_failure_not_a_crash(server):
    rec = await _send(server[0], "slow", n=3, request_timeout_s=0.3)
    assert rec.error.startswith("timeout"), rec.error
    assert rec.finished < 3.0


async def test_connection_refused_is_a_failure():
    rec = await _send("http://127.0.0.1:9", "normal")
    assert rec.error.startswith(("connect", "disconnected")), rec.error


async def test_request_on_a_dead_keepalive_connection_is_retried(server):
    spec = RequestSpec([1, 2], 2, 2)
    cfg = ClientConfig(server[0], model="one_per_connection")
    async with StreamClient(cfg) as client:
        recs = [await client.send(spec, RequestRecord(index=i), time.perf_counter())
                for i in range(3)]
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert recs[0].retries == 0 and max(r.retries for r in recs) >= 1


async def test_resolve_model_and_a_short_run(server):
    url, _ = server
    specs = iter([RequestSpec([1, 2], 2, 2)] * 4 + [RequestSpec([1], 1, 1)] * 2)
    async with StreamClient(ClientConfig(url)) as client:
        assert await client.resolve_model() == "normal"
        cfg = RunConfig(request_rate=50.0, max_concurrency=2, num_requests=5)
        result = await timed_run(client, cfg, specs)
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert all(r.ok for r in result.records)
    assert all(r.sent >= r.scheduled for r in result.records)
    assert result.records[4].output_tokens == 1 and tpot(result.records[4]) is None


def test_sse_parser_handles_split_events_comments_and_multiline_data():
    p = SSEParser()
    assert p.feed(b": ping\r\n\r\nda") == []
    assert p.feed(b"ta: {\"a\":\n") == []
    assert p.feed(b"data: 1}\n\nevent: error\ndata: x\r") == [("message", '{"a":\n1}')]
    assert p.feed(b"\n\r\n") == [("error", "x")]
    e_acute = "é".encode()
    assert p.feed(b"data: " + e_acute[:1]) == []
    assert p.feed(e_acute[1:] + b"\n") == []
    assert p.close() == [("message", "é")]


def test_cli_sweep_json_plots_and_compare(threaded_server, tmp_path, capsys):
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--base-url", threaded_server + "/v1", "--input-len", "uniform:3:9",
              "--output-len", "3", "--num-requests", "6", "--warmup", "2",
              "--max-concurrency", "4", "--slo", "ttft:2000", "tpot:1000", "--quiet"]
    plots = ["--plot", str(tmp_path / "plots")] if HAVE_MPL else []
    assert cli.main([*common, "--sweep", "50,inf", "-o", str(out_a), *plots]) == 0
    assert cli.main([*common, "--workload", "mixed", "--long-fraction", "0.5",
                     "--long-input-len", "30", "-o", str(out_b), "--label", "B"]) == 0
    doc = json.loads(out_a.read_text())
    assert doc["schema_version"] == 1 and doc["server"]["model"] == "normal"
    assert [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["requests"] == {"total": 6, "completed": 6, "failed": 0}
        assert s["tokens"]["output"] == 18 and s["goodput"]["good_requests"] == 6
        assert len(run["requests"]) == 6 and run["warmup_failed"] == 0
    if HAVE_MPL:
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
            "latency_cdf.png", "throughput_vs_latency.png"]
    doc_b = json.loads(out_b.read_text())
    assert set(doc_b["runs"][0]["categories"]) == {"interactive", "long"}
    capsys.readouterr()
    plots = ["--plot", str(tmp_path / "cmp")] if HAVE_MPL else []
    assert cli.main(["compare", str(out_a), str(out_b), *plots]) == 0
    shown = capsys.readouterr().out
    assert "output tok/s" in shown and "B / " in shown
    assert (tmp_path / "cmp" / "latency_cdf_run0.png").exists() or not HAVE_MPL


def test_cli_quiet_without_output_prints_the_result(threaded_server, capsys):
    assert cli.main(["--base-url", threaded_server + "/v1", "--input-len", "5", "--output-len", "3",
                     "--num-requests", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # stdout is the JSON result alone
    assert doc["runs"][0]["summary"]["requests"]["completed"] == 3


def test_cli_reports_unreachable_server(capsys):
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--num-requests", "1",
                     "--quiet"]) == 2
    assert "cannot list models" in capsys.readouterr().err


async def test_chat_with_token_ids_fails_with_the_fix_named(server):
    spec = RequestSpec([1, 2, 3], 3, 2)
    async with StreamClient(ClientConfig(server[0], "chat", model="normal")) as client:
        rec = await client.send(spec, RequestRecord(index=0), time.perf_counter())
    assert rec.error.startswith("client_error") and "--prompt-format text" in rec.error
    assert server[1][BODIES] == []  # nothing was sent


def test_add_parser_mounts_bench_under_a_parent_cli(tmp_path):
    import argparse

    parent = argparse.ArgumentParser(prog="tandem")
    cli.add_parser(parent.add_subparsers(dest="command"))
    args = parent.parse_args(["bench", "compare", str(tmp_path / "missing.json")])
    assert args.bench_argv == ["compare", str(tmp_path / "missing.json")]
    assert args.func(args) == 2
    args = parent.parse_args(["bench", "--base-url", "x", "--num-requests", "1"])
    assert args.bench_argv == ["--base-url", "x", "--num-requests", "1"]
