"""What the HTTP layer needs from an engine, wherever the engine lives.

`AsyncEngine` satisfies it in-process (bare mode); in Ray Serve mode the ingress wraps a
replica handle in an object with the same shape. `app/` depends only on this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.request import Request, RequestClass, TokenDelta
from engine.stats import EngineStats


class EngineClient(Protocol):
    def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        """Stream deltas; closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def check_admission(self, request_class: RequestClass, count: int) -> None:
        """Raise `QueueFull` (with the engine rule's Retry-After) at once when `count` more
        requests of `request_class` would be refused now. A cheap local estimate made before
        any tokenizing, so an overloaded server answers 429 without doing the work of a
        request it cannot take; `generate` still has the engine's own decision. A client
        may hold the `count` places for the requests until they start; a caller whose
        requests will not start after all (a bad prompt) calls `release_admission`."""
        ...

    def release_admission(self, count: int) -> None:
        """Give back places `check_admission` took for `count` requests that will not
        start."""
        ...

    def stats(self) -> EngineStats:
        """The engine's stats now (summed over replicas where the client fronts several)."""
        ...
