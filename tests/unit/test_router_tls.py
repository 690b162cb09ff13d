"""The router serves HTTPS with --ssl-certfile/--ssl-keyfile (vLLM's flags), and asks
for client certificates with --ssl-ca-certs/--ssl-cert-reqs: the command line's own
uvicorn config (cli/serve.py http_config) on a real server on 127.0.0.1, with a CA the
test makes. Half a pair of flags is refused before anything starts."""

from __future__ import annotations

import asyncio
import socket
import ssl

import httpx
import pytest
import uvicorn

from cli.checks import CommandError
from cli.main import build_parser
from cli.serve import check_tls_args, http_config
from tests.harness.certs import CertAuthority

pytestmark = pytest.mark.unit


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("tls"))


async def _serve(args, requests):
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(http_config(args, _app))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        return await asyncio.to_thread(requests, port)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        sock.close()


def test_https_with_the_routers_own_config(ca):
    cert, key = ca.issue("router", dns=("localhost",), ips=("127.0.0.1",))
    args = build_parser().parse_args(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    check_tls_args(args)

    def requests(port):
        ok = httpx.get(f"https://127.0.0.1:{port}/health", verify=ssl.create_default_context(cafile=ca.path))
        with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)
        with pytest.raises(httpx.ConnectError):  # a client that does not know the CA refuses the server
            httpx.get(f"https://127.0.0.1:{port}/health")
        return ok

    ok = asyncio.run(_serve(args, requests))
    assert ok.status_code == 200 and ok.text == "ok"


def test_client_certificates_required(ca):
    cert, key = ca.issue("router2", ips=("127.0.0.1",))
    client_cert, client_key = ca.issue("client")
    (ca.dir / "other").mkdir(exist_ok=True)
    bad_cert, bad_key = CertAuthority(ca.dir / "other", name="another CA").issue("intruder")
    args = build_parser().parse_args(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                                      "--ssl-ca-certs", str(ca.path), "--ssl-cert-reqs", "2"])
    check_tls_args(args)

    def client(cert_pair=None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=ca.path)
        if cert_pair:
            ctx.load_cert_chain(*map(str, cert_pair))
        return ctx

    def requests(port):
        url = f"https://127.0.0.1:{port}/health"
        ok = httpx.get(url, verify=client((client_cert, client_key)))
        for ctx in (client(), client((bad_cert, bad_key))):  # none, or one the CA did not sign
            with pytest.raises(httpx.HTTPError):
                httpx.get(url, verify=ctx, timeout=3)
        return ok

    assert asyncio.run(_serve(args, requests)).status_code == 200


@pytest.mark.parametrize("argv, said", [
    (["--ssl-certfile", "c.pem"], "both --ssl-certfile and --ssl-keyfile"),
    (["--ssl-keyfile", "k.pem"], "both --ssl-certfile and --ssl-keyfile"),
    (["--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"], "cannot read"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs --ssl-ca-certs"),
    (["--ssl-ca-certs", "ca.pem"], "give --ssl-certfile and --ssl-keyfile too"),
])
def test_half_a_tls_setting_is_refused(argv, said):
    with pytest.raises(CommandError, match=said):
        check_tls_args(build_parser().parse_args(["serve", *argv]))
