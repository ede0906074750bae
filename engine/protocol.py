"""What the HTTP layer needs from an engine, wherever the engine lives.

`AsyncEngine` satisfies it in-process (bare mode); in Ray Serve mode the ingress wraps a
replica handle in an object with the same shape. `app/` depends only on this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.request import Request, TokenDelta
from engine.stats import EngineStats


class EngineClient(Protocol):
    def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        """Stream deltas; closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """The engine's stats now (summed over replicas where the client fronts several)."""
        ...
