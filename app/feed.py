"""Fan-in of the engine streams of one HTTP request (one stream per choice).

One pump task per engine stream moves deltas into a bounded queue; the reader takes
everything that is ready at once and merges the deltas of each choice into one
(`engine.request.merge_deltas`), so a client slower than the model receives fewer, larger
chunks while a fast client receives every delta the moment it exists. There is no timer
anywhere on this path: `next_batch(timeout)` only bounds how long the reader waits when
nothing is ready (for SSE keepalives). A full queue stops the pumps, which stops pulling
from the engine (backpressure). `close()` closes every engine iterator, which aborts
unfinished requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from app.openai.errors import EngineRequestError
from engine.protocol import EngineClient
from engine.request import Request, TokenDelta, merge_deltas

QUEUE_SIZE_PER_STREAM = 64


class DeltaFeed:
    """Deltas of `requests` (choice index = position in `requests`) from `client`."""

    def __init__(self, client: EngineClient, requests: Sequence[Request]) -> None:
        self._queue: asyncio.Queue[tuple[int, TokenDelta | BaseException]] = asyncio.Queue(
            QUEUE_SIZE_PER_STREAM * len(requests)
        )
        self._remaining = len(requests)
        self._pumps = [
            asyncio.create_task(self._pump(i, client, request), name=f"pump-{request.request_id}")
            for i, request in enumerate(requests)
        ]

    @property
    def finished(self) -> bool:
        """Every choice has delivered its finishing delta to the reader."""
        return self._remaining == 0

    async def _pump(self, index: int, client: EngineClient, request: Request) -> None:
        stream: AsyncIterator[TokenDelta] | None = None
        try:
            stream = client.generate(request)
            async for delta in stream:
                await self._queue.put((index, delta))
                if delta.finish_reason is not None:
                    return
            raise EngineRequestError(f"engine stream of {request.request_id} ended unfinished")
        except Exception as exc:
            await self._queue.put((index, exc))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def next_batch(self, timeout: float | None) -> list[tuple[int, TokenDelta]]:
        """Everything ready now (waiting up to `timeout` s for the first item), coalesced
        per choice in order of first appearance; `[]` when the wait timed out. Raises the
        first engine exception seen."""
        queue = self._queue
        items: list[tuple[int, TokenDelta | BaseException]] = []
        if queue.empty():
            try:
                async with asyncio.timeout(timeout):
                    items.append(await queue.get())
            except TimeoutError:
                return []
        while not queue.empty():
            items.append(queue.get_nowait())
        by_choice: dict[int, list[TokenDelta]] = {}
        for index, item in items:
            if isinstance(item, BaseException):
                raise item
            by_choice.setdefault(index, []).append(item)
            if item.finish_reason is not None:
                self._remaining -= 1
        return [(index, merge_deltas(deltas)) for index, deltas in by_choice.items()]

    async def close(self) -> None:
        """Stop all pumps and close their engine iterators (aborting unfinished requests)."""
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
