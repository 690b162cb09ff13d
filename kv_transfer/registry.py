"""The backend registry: a transport by name, with NIXL imported only when asked for
(or tried by "auto"), so a machine without it falls back to TCP with one log line."""

from __future__ import annotations

import logging

from kv_transfer.base import Transport, TransportConfig

logger = logging.getLogger("tandem.kv_transfer")

TRANSPORTS = ("auto", "nixl", "tcp")


def create_transport(name: str, config: TransportConfig) -> Transport:
    """Make a transport by name: "nixl", "tcp", or "auto" (NIXL when an agent can
    be created here, else TCP; one log line says which and why)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {TRANSPORTS}")
    if name == "tcp":
        return _make_tcp(config)
    if name == "nixl":  # asked for by name: no fallback, one clear error
        try:
            return _make_nixl(config)
        except Exception as e:
            raise RuntimeError(f"--transport nixl: NIXL is unavailable here ({type(e).__name__}: {e}); "
                               "--transport auto falls back to tcp, --transport tcp asks for it") from e
    try:
        transport = _make_nixl(config)
    except Exception as e:  # any failure to import or start NIXL means: fall back
        logger.warning(
            "kv_transfer: using tcp fallback (nixl unavailable: %s: %s)", type(e).__name__, e
        )
        return _make_tcp(config)
    logger.info("kv_transfer: using nixl (%s)", transport.describe())
    return transport


def _make_nixl(config: TransportConfig) -> Transport:
    from kv_transfer.nixl import NixlTransport

    return NixlTransport(config)


def _make_tcp(config: TransportConfig) -> Transport:
    from kv_transfer.tcp import TcpTransport

    return TcpTransport(config)
