"""The DraftReplica deployment: a draft model and its KV pool, proposing for every target.

Target replicas reach it over the direct channel of `actors/draft_channel.py`: each asks
`address()` once through a Serve handle (again only after losing it), then sends one frame
per engine step over TCP. Calls from all targets that arrive while a batch is being drafted
are drafted together in the next batch (one `DraftModel.propose` for all of them), on one
worker thread; the event loop only moves frames. Between batches, while the targets verify,
the worker drafts each sequence's next step ahead (`DraftService.look_ahead`), so a run the
target accepts whole gets its next drafts without waiting for the draft model.

A connection that closes (a target replica gone, or one that timed out) frees the KV of
every sequence it was drafting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle

from ray import serve

from actors.draft_channel import MAX_FRAME_BYTES, DraftService, ProposeCall, Release
from actors.runtime import node_ip, route_logs
from actors.settings import AppConfig
from demo.paths import resolve_model
from engine.spec.draft_model import DraftModel

logger = logging.getLogger("firstlight.draft")

_HEADER_SIZE = 4


@serve.deployment(name="DraftReplica")
class DraftReplica:
    async def __init__(self, config: AppConfig) -> None:  # type: ignore[misc]
        route_logs()
        spec = config.engine.speculative
        settings = config.draft_replica
        draft = await asyncio.to_thread(
            DraftModel,
            resolve_model(spec.draft_model),
            kv_cache_bytes=settings.kv_cache_bytes,
            dtype=config.engine.dtype,
            device=config.engine.device,
            block_size=config.engine.cache.block_size,
            seed=config.engine.seed,
            fused_ops=config.engine.fused_ops,
        )
        self.service = DraftService(draft)
        self._pending: list[tuple[int, ProposeCall, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        host = "127.0.0.1" if settings.host == "loopback" else node_ip()
        self._server = await asyncio.start_server(self._serve_connection, host=host, port=0)
        self._address = (host, self._server.sockets[0].getsockname()[1])
        self._worker = asyncio.create_task(self._draft_loop())
        logger.info("draft replica %s listening on %s:%d", spec.draft_model, *self._address)

    async def address(self) -> tuple[str, int]:
        return self._address

    async def check_health(self) -> None:
        if self._worker.done():
            raise RuntimeError("the draft loop stopped")

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        session = self.service.open_session()
        loop = asyncio.get_running_loop()
        try:
            while True:
                header = await reader.readexactly(_HEADER_SIZE)
                size = int.from_bytes(header, "big")
                if size > MAX_FRAME_BYTES:
                    raise ConnectionError(f"frame of {size} bytes")
                call = pickle.loads(await reader.readexactly(size))
                if isinstance(call, Release):
                    await self._run(self.service.release, session, call.request_ids)
                    continue
                if not isinstance(call, ProposeCall):
                    raise ConnectionError(f"unexpected {type(call).__name__}")
                done: asyncio.Future = loop.create_future()
                self._pending.append((session, call, done))
                self._wake.set()
                reply = await done
                payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
                writer.write(len(payload).to_bytes(_HEADER_SIZE, "big") + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the target went away (or timed out and dropped us): normal
        finally:
            await self._run(self.service.close_session, session)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _draft_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                replies = await self._run(
                    self.service.handle, [(session, call) for session, call, _ in batch]
                )
            except Exception as exc:  # a failed batch costs its targets one step's drafts
                logger.exception("drafting failed")
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(ConnectionError(str(exc)))
                continue
            for (_, _, done), reply in zip(batch, replies, strict=True):
                if not done.done():
                    done.set_result(reply)
            if not self._pending:  # the targets verify now: draft their next step meanwhile
                try:
                    await self._run(self.service.look_ahead)
                except Exception:
                    logger.exception("drafting ahead failed")

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        """`fn(*args)` on a worker thread, one at a time (the service is not thread-safe)."""
        async with self._lock:
            return await asyncio.to_thread(fn, *args)
