"""The router's environment variables (the worker runtime's, which the router's process
reads too, are worker_runtime/envs.py's).

    TANDEM_TOKEN_FEED  0 has the router read each request's tokens from its own Decode
                       stream instead of one token feed per decode worker (router/token_feed.py)
    TANDEM_FEED_SOCKET  0 keeps a token feed's batches on its gRPC stream instead of
                       moving them to a plain TCP connection to the worker
"""

from __future__ import annotations

from engine.envs import switch_on


def token_feed() -> bool:
    return switch_on("TANDEM_TOKEN_FEED")


def feed_socket() -> bool:
    return switch_on("TANDEM_FEED_SOCKET")
