"""Run work for a client only while the client is still there.

Uvicorn (and the Serve proxy) deliver `http.disconnect` on `receive()` once the request body
has been read and the connection goes away. `until_disconnected` races work against that
message; on a disconnect the work task is cancelled and awaited (so its cleanup, e.g.
aborting engine requests, has finished) before `ClientDisconnected` is raised. The same
holds when the caller itself is cancelled, even repeatedly (a server cancelling a handler
twice): the work has always ended when `until_disconnected` returns or raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away before the work finished."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has ended; a cancel of the waiter meanwhile is held
    back (re-raised after the wait), so the task's cleanup never races its caller's."""
    task.cancel()
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def until_disconnected(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """`await work`, unless the client disconnects first (then `ClientDisconnected`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled: never leave either task running
        watcher.cancel()
        await _cancel_and_wait(task)
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    await _cancel_and_wait(task)
    for finished in (task, watcher):  # retrieve outcomes so asyncio does not warn
        if not finished.cancelled():
            finished.exception()
    raise ClientDisconnected
