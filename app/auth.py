"""Optional API keys for every `/v1` route (`Authorization: Bearer <key>`).

Off while no key is configured (the local demo). Keys come from `auth.api_keys` (e.g. the
environment: `FIRSTLIGHT_AUTH__API_KEYS='["k1","k2"]'`) and/or `auth.api_keys_file` (one
key per line; `#` comments). A request to `/v1/...` without a valid key gets 401 in the
OpenAI error schema before the app reads its body; a valid one runs with
`scope["state"]["owner"]` set to the key's owner id (a hash of the key, never the key), which
the files and batches endpoints filter by: a key sees only what it created. Keys are compared
in constant time, every configured key every time. `/`, `/health`, `/metrics`, `/status` and
the playground's assets stay open.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

from app.errors import error_response
from app.openai.errors import APIError
from app.settings import AuthSettings


def load_keys(settings: AuthSettings) -> list[str]:
    keys = [k for k in settings.api_keys if k]
    if settings.api_keys_file:
        for raw in Path(settings.api_keys_file).expanduser().read_text().splitlines():
            key = raw.strip()
            if key and not key.startswith("#"):
                keys.append(key)
    return keys


def owner_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class AuthMiddleware:
    def __init__(self, app: Any, keys: Iterable[str]) -> None:
        self.app = app
        self._keys = [(k.encode(), owner_id(k)) for k in keys]

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        owner = self._owner(dict(scope["headers"]).get(b"authorization", b""))
        if owner is None:
            error = APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
            await error_response(error)(scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)

    def _owner(self, header: bytes) -> str | None:
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer":
            given = b""
        found = None
        for key, owner in self._keys:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(key, given.strip()):
                found = owner
        return found
