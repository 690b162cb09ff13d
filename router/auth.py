"""API keys (`Authorization: Bearer <key>`) on the OpenAI endpoints, and a separate
admin key on /admin.

- No API keys configured: the OpenAI endpoints are open (as vLLM without --api-key).
- Keys come from a list and/or a file (one key per line; blank lines and `#` comments
  ignored), read once when the app is built.
- Comparison is constant-time against every key (no early exit on a match).
- The admin key is its own secret: an API key never opens /admin, and with no admin
  key configured /admin is closed (403). Missing/malformed credentials: 401;
  a well-formed key that is not the admin key: 403.
- /health, /ready and /metrics need no key (probes and Prometheus scrape them).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Iterable

from fastapi import Request

from router.errors import ApiError


def read_key_file(path: str | Path) -> list[str]:
    """Keys in a file: one per line, `#` starts a comment."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path}: {e}") from e
    return [k for k in (line.split("#", 1)[0].strip() for line in lines) if k]


def _matches(candidate: str, keys: Iterable[bytes]) -> bool:
    given = candidate.encode("utf-8")
    hits = [hmac.compare_digest(given, k) for k in keys]  # all compared: no timing by position
    return any(hits)


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class KeyChecker:
    def __init__(self, api_keys: Iterable[str] = (), admin_key: str | None = None) -> None:
        self._api_keys = [k.encode("utf-8") for k in sorted(set(api_keys)) if k]
        self._admin_key = admin_key.encode("utf-8") if admin_key else None

    def require_api_key(self, request: Request) -> None:
        """Raise 401 unless the request carries a configured API key (or none are set)."""
        if not self._api_keys:
            return
        token = bearer_token(request)
        if token is None:
            raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
        if not _matches(token, self._api_keys):
            raise _unauthorized("incorrect API key provided")

    def require_admin(self, request: Request) -> None:
        """Raise 401/403 unless the request carries the admin key."""
        if self._admin_key is None:
            raise ApiError(403, "the admin API is disabled: start the router with an admin key",
                           None, "admin_disabled")
        token = bearer_token(request)
        if token is None:
            raise _unauthorized("missing admin key: send `Authorization: Bearer <admin key>`")
        if not _matches(token, [self._admin_key]):
            raise ApiError(403, "this key does not grant admin access", None, "forbidden")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
