"""ReplicaClient: an `EngineClient` that streams from the ModelReplica deployment.

The app (app/) sees the same contract as in bare mode: `generate(request)` is an async
iterator of `TokenDelta`s that raises `ValueError` (400), `QueueFullError` (429) or
`EngineUnavailableError` (503) before the first delta, and closing it early aborts the
request. Each delta crosses exactly one actor hop (replica → this process); this object adds
no queue, timer or extra task on that path (the app's own feed does any coalescing).

Translation of what can go wrong across the hop:
* a `ReplicaError` item (the replica refused the request) → the exception it names;
* Serve's `BackPressureError` (every replica at `max_ongoing_requests` and the handle's own
  queue full) → `QueueFullError`;
* no replica to route to, or the replica died → `EngineUnavailableError` (a 503 before the
  first token; an SSE error event after it);
* any other remote failure → `RuntimeError` (a 500, logged by the app).

`admit(request)`, called before anything is sent, lets the ingress refuse early from its
local cluster-view cache (never a remote call).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from actors.messages import ReplicaError
from engine.protocol import EngineUnavailableError, QueueFullError
from engine.request import Request, TokenDelta

_UNAVAILABLE = (
    ActorDiedError,
    ActorUnavailableError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)


class ReplicaClient:
    def __init__(
        self,
        handle: DeploymentHandle,
        *,
        admit: Callable[[Request], None] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
        transport: dict[str, Any] | None = None,
    ) -> None:
        self._stream = handle.options(stream=True, **(transport or {}))
        self._admit = admit
        self._stats = stats
        self._inflight: dict[str, Any] = {}  # request id → DeploymentResponseGenerator

    async def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        if self._admit is not None:
            self._admit(request)
        response = self._stream.generate.remote(request)
        rid = request.request_id
        self._inflight[rid] = response
        finished = False
        try:
            async for item in response:
                if isinstance(item, ReplicaError):
                    finished = True  # the replica's call is over: nothing to cancel
                    raise item.exception()
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
            raise RuntimeError(f"replica stream of {rid} ended before its last delta")
        except BackPressureError as exc:
            raise QueueFullError(str(exc), retry_after_s=exc.retry_after_s or 1.0) from None
        except _UNAVAILABLE as exc:
            raise EngineUnavailableError(f"model replica unavailable: {exc}") from None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, _UNAVAILABLE):
                raise EngineUnavailableError(f"model replica unavailable: {cause}") from None
            raise RuntimeError(f"model replica failed: {cause!r}") from None
        finally:
            self._inflight.pop(rid, None)
            if not finished:
                # The replica sees CancelledError and aborts the request. Serve's cancel()
                # re-raises a failed assignment's error (e.g. BackPressureError): not ours.
                with contextlib.suppress(Exception):
                    response.cancel()

    async def abort(self, request_id: str) -> None:
        response = self._inflight.get(request_id)
        if response is not None:
            with contextlib.suppress(Exception):
                response.cancel()

    def stats(self) -> dict[str, Any]:
        """Replica stats summed from the ingress's cached cluster view (may be ~1 s old)."""
        return self._stats() if self._stats is not None else {}
