"""gRPC plumbing shared by the router and the workers: servers that accept only
cluster members (a shared token in the call metadata), client channels that carry
it, and the per-process CPU setup of a worker.

With cluster TLS set for the process (`use_cluster_tls`, kv_transfer/tls.py), servers
listen with TLS and require a client certificate signed by the cluster CA, and channels
present this process's certificate and check the server's for the cluster name."""

from __future__ import annotations

import hmac
import logging
import secrets

import grpc

from kv_transfer.tls import ClusterTLS

log = logging.getLogger(__name__)
_tls: ClusterTLS | None = None  # the process's cluster TLS (one process, one cluster identity)
_server_creds: grpc.ServerCredentials | None = None
_channel_creds: grpc.ChannelCredentials | None = None


def use_cluster_tls(tls: ClusterTLS | None) -> None:
    """Every server and channel this process makes from now on uses `tls` (None: plaintext)."""
    global _tls, _server_creds, _channel_creds
    _tls, _server_creds, _channel_creds = tls, None, None
    if tls is not None:
        cert, key, ca = tls.read()
        _server_creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        _channel_creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def cluster_tls() -> ClusterTLS | None:
    return _tls

TOKEN_HEADER = "x-tandem-token"
MAX_MESSAGE_BYTES = 64 << 20
# Keepalive, one setting for both ends of every channel: clients (routers, the
# controller, workers handshaking) ping every KEEPALIVE_MS, idle or not, to notice a
# dead peer; servers accept pings that often (by default gRPC servers refuse pings more
# often than every 5 minutes without data: two strikes and they send GOAWAY
# too_many_pings, which cut streams once a minute) and ping their own clients as often.
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def _keepalive() -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def server_options() -> list[tuple[str, int]]:
    return _OPTIONS + _keepalive() + [
        # a client pinging every KEEPALIVE_MS is within bounds, with slack for timer jitter
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def client_options() -> list[tuple[str, int]]:
    return _OPTIONS + _keepalive() + [("grpc.enable_retries", 0)]


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Rejects calls whose metadata lacks the cluster token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        given = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if handler is None or hmac.compare_digest(given.encode(), self.token):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        yield  # pragma: no cover (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


async def start_server(add_servicers, host: str, port: int, token: str | None) -> tuple[grpc.aio.Server, int]:
    """Start an asyncio gRPC server on host:port (0 = any free port); returns it and
    the bound port. `add_servicers(server)` registers the services."""
    interceptors = [_TokenCheck(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors, options=server_options())
    add_servicers(server)
    if _server_creds is not None:
        bound = server.add_secure_port(f"{host}:{port}", _server_creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC server could not bind {host}:{port}")
    await server.start()
    return server, bound


def new_epoch() -> int:
    """A random 63-bit id naming one incarnation of a worker (a restart gets a new one)."""
    return secrets.randbits(63) or 1


def epoch_str(epoch: int) -> str:
    """An epoch as every log line, status table and NIXL agent name shows it: 16 hex digits."""
    return f"{epoch:016x}"


def channel(address: str) -> grpc.aio.Channel:
    if _tls is None:
        return grpc.aio.insecure_channel(address, options=client_options())
    return grpc.aio.secure_channel(address, _channel_creds,
                                   options=client_options() + [("grpc.ssl_target_name_override", _tls.server_name)])


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, token),) if token else ()
