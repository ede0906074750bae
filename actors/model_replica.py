"""The ModelReplica deployment: one `AsyncEngine` behind a streaming Serve method.

What it adds to the engine, and nothing else:
* readiness: `__init__` loads the weights, starts the engine loop and runs one real one-token
  request, so Serve routes to a new replica (scale-up, replacement) only once it is warm;
* `stream_to(request, address)` (the token path): the request's deltas go over the token
  channel to the ingress at `address` (actors/token_channel.py), one frame per engine step
  for all of that ingress's requests; the call itself returns once the last delta is on the
  socket, or returns a `ReplicaError` when the engine refuses the request or dies under it.
  When the caller goes away (client disconnect → Serve cancels the call → `CancelledError`
  here) the request is aborted within one engine step and its KV blocks return;
* `stream_group(requests, address)`: several requests in one Serve call, each as by
  `stream_to` (a caller's bulk requests that want their output whole, e.g. a batch's lines:
  see actors/replica_client.py); returns their outcomes in order once all have ended (what
  fails one request, a refusal before or after it started, is a `ReplicaError` of its own;
  only a broken token channel fails the call), and cancelling it aborts those still running;
* `generate(request)`: the same over a Serve stream (one item per delta; the first one is
  yielded the moment it exists), for `ingress.token_path: stream`;
* `check_health` fails once the engine loop has died, so Serve replaces the replica;
* stats: pushed to the control plane every `stats_interval_s` from a background task (never
  awaited by a request), with the change of its prefix cache since the last push (the sketch
  routers route by; the whole set first and after any failed push), served by `stats()`,
  published to Serve's router through `record_routing_stats` and to the autoscaler through
  `record_autoscaling_stats`;
* cold start: a replica started by a scale-up reports the time from the autoscaler's
  decision (actors/autoscaler.py) to the first token it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.autoscaler import autoscaling_stats, scale_up_decided_before
from actors.cluster import ReplicaReport
from actors.draft_channel import RemoteDraftProposer
from actors.messages import ReplicaError, ReplicaInfo, ReplicaStats
from actors.runtime import deployment_name, node_id, replica_id, route_logs, rss_bytes
from actors.settings import AppConfig
from actors.token_channel import ChannelAddress, ChannelClosedError, ChannelPool
from demo.paths import resolve_model
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequest, QueueFull, Unavailable
from engine.process import freeze_startup_heap
from engine.request import Request, SamplingParams, TokenDelta
from engine.tokenizer import tokenizer_digest

logger = logging.getLogger("firstlight.replica")


@serve.deployment(name="ModelReplica")
class ModelReplica:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        config: AppConfig,
        control_plane: DeploymentHandle | None = None,
        draft_replica: DeploymentHandle | None = None,
    ):
        route_logs()
        self.started_at = time.time()
        self.config = config
        self.control_plane = control_plane
        self.replica_id = replica_id()
        self.cold_start_s: float | None = None
        self._cold_start_pending = True  # until measured, or known to have none
        self.channels = ChannelPool(node_id())
        # Drafts from the DraftReplica when there is one; else whatever the engine config says
        # (an in-process draft model, prompt lookup, or none).
        self.drafts: RemoteDraftProposer | None = None
        if draft_replica is not None:
            self.drafts = RemoteDraftProposer(timeout_s=config.draft_replica.timeout_s)
        self.engine = await asyncio.to_thread(
            AsyncEngine.from_config,
            config.engine,
            resolve_model=resolve_model,
            proposer=self.drafts,
        )
        self._tokenizer_digest = tokenizer_digest(self.engine.tokenizer)
        self._draft_finder: asyncio.Task | None = None
        if draft_replica is not None:
            self._draft_finder = asyncio.create_task(
                self._find_draft_replica(draft_replica), name="find-draft-replica"
            )
        await self.engine.warmup()
        await self.engine.start()
        await self._warm_request()
        self.engine.first_delta_at = None  # the warm-up's token is not a token served
        self._reporter = asyncio.create_task(self._report_loop(), name="replica-stats")
        freeze_startup_heap()
        logger.info("replica %s ready (%s)", self.replica_id, self.config.engine.model)

    async def _warm_request(self) -> None:
        """One real request through the whole engine path (schedule, forward, sample, detok)."""
        ids = list(self.engine.tokenizer.encode("Hello"))[:8] or [0]
        request = Request(f"warmup-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1))
        async for _ in self.engine.generate(request):
            pass

    # -- the token path ------------------------------------------------------------------

    async def stream_to(self, request: Request, address: ChannelAddress) -> ReplicaError | None:
        request.to_local_clock()
        if not self.engine.is_healthy:
            return ReplicaError.from_exception(Unavailable("the engine is not running"))
        conn = await self.channels.connection(address)
        rid = request.request_id
        slot = conn.open(rid)
        try:
            self.engine.attach(request, slot)
        except (InvalidRequest, QueueFull) as exc:  # refused before the first token
            conn.close_slot(rid)
            return ReplicaError.from_exception(exc)
        finished = False
        try:
            await slot.done
            finished = True
            return None
        except Exception as exc:
            if self.engine.is_healthy:
                raise  # the channel broke (the ingress is gone) or its reader stalled
            return ReplicaError.from_exception(Unavailable(str(exc)))  # engine died
        finally:
            self.engine.detach(rid, abort=not finished)
            conn.close_slot(rid)

    async def stream_group(
        self, requests: list[Request], address: ChannelAddress
    ) -> list[ReplicaError | None]:
        async def one(request: Request) -> ReplicaError | None:
            try:
                return await self.stream_to(request, address)
            except ChannelClosedError:
                raise  # the ingress is gone: every request of the call with it
            except Exception as exc:  # this request's alone (a late refusal, a stalled reader)
                return ReplicaError.from_exception(exc)

        async with asyncio.TaskGroup() as group:  # one failing (the channel broke) ends all
            tasks = [group.create_task(one(r)) for r in requests]
        return [task.result() for task in tasks]

    async def generate(self, request: Request) -> AsyncIterator[TokenDelta | ReplicaError]:
        request.to_local_clock()
        if not self.engine.is_healthy:
            yield ReplicaError.from_exception(Unavailable("the engine is not running"))
            return
        stream = self.engine.generate(request)
        try:
            async for delta in stream:
                yield delta
        except (InvalidRequest, QueueFull) as exc:  # refused before the first token
            yield ReplicaError.from_exception(exc)
        except RuntimeError as exc:
            if self.engine.is_healthy:
                raise
            yield ReplicaError.from_exception(Unavailable(str(exc)))  # engine died
        finally:
            await stream.aclose()  # a no-op when finished; otherwise aborts the request

    # -- health and stats ----------------------------------------------------------------

    async def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine of replica {self.replica_id} is not running")

    async def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.replica_id,
            model=self.config.served_model_name,
            model_path=str(self.engine.engine.model_path),
            max_model_len=self.engine.max_model_len,
            tokenizer_digest=self._tokenizer_digest,
        )

    async def stats(self) -> ReplicaStats:
        """Engine stats plus `replica_id` and `rss_bytes` (resident memory of this process)."""
        return ReplicaStats(self.replica_id, rss_bytes(), self.engine.stats())

    async def record_routing_stats(self) -> dict[str, float]:
        """What Serve's request router reads (Serve takes a dict of numbers here)."""
        stats = self.engine.stats()
        return {
            "kv_cache_usage_perc": stats.kv.usage,
            "kv_num_free_blocks": stats.kv.num_free_blocks,
            "num_requests_running": stats.running.total,
            "num_requests_waiting": stats.waiting.total,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the autoscaler (actors/autoscaler.py) reads: requests in the engine, KV usage,
        TTFT p95 per class over the engine's recent window."""
        stats = self.engine.stats()
        return autoscaling_stats(
            stats.running.total + stats.waiting.total,
            stats.kv.usage,
            stats.ttft_p95_interactive_s,
            stats.ttft_p95_bulk_s,
        )

    async def _measure_cold_start(self) -> None:
        """Once this replica has served a token: the time from the scale-up decision that
        started it. A replica started with the deployment has none; the decision's record
        may land a tick after the replica is up, so it is looked for for a few seconds."""
        served = self.engine.first_delta_at
        if served is None:
            return
        app, deployment = deployment_name()
        decided = await asyncio.to_thread(scale_up_decided_before, app, deployment, self.started_at)
        if decided is not None:
            self.cold_start_s = served - decided
            self._cold_start_pending = False
            logger.info("replica %s: cold start %.2f s", self.replica_id, self.cold_start_s)
        elif time.time() - served > 10.0:
            self._cold_start_pending = False

    async def _find_draft_replica(self, handle: DeploymentHandle) -> None:
        """Keep the draft proposer supplied with the DraftReplica's address: asked through the
        Serve handle only while the proposer has no working connection (at start, and after
        the DraftReplica died or stalled; Serve routes the call to its replacement)."""
        assert self.drafts is not None
        interval = self.config.draft_replica.address_refresh_s
        while True:
            if self.drafts.needs_address():
                try:
                    async with asyncio.timeout(max(5.0, interval)):
                        address = await handle.address.remote()
                    self.drafts.set_address(tuple(address))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # decoding goes on without drafts meanwhile
                    logger.info("no draft replica yet: %r", exc)
            await asyncio.sleep(interval)

    async def _report_loop(self) -> None:
        interval = self.config.replica.stats_interval_s
        sketch = self.engine.engine.sketch
        full = True  # the whole sketch first, and after a push that failed or did not fit
        while self.control_plane is not None:
            try:
                if self._cold_start_pending:
                    await self._measure_cold_start()
                update = sketch.take(full=full) if sketch is not None else None
                full = True
                report = ReplicaReport(
                    replica_id=self.replica_id,
                    model=self.config.served_model_name,
                    stats=self.engine.stats(),
                    healthy=self.engine.is_healthy,
                    sketch=update,
                    cold_start_s=self.cold_start_s,
                )
                async with asyncio.timeout(max(1.0, 4 * interval)):
                    full = not await self.control_plane.report_replica.remote(report)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the control plane is optional for serving tokens
                logger.debug("stats push failed: %r", exc)
            await asyncio.sleep(interval)

    async def __del__(self) -> None:
        for task in (getattr(self, "_reporter", None), getattr(self, "_draft_finder", None)):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.control_plane is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self.control_plane.remove_replica.remote(self.replica_id)
        channels = getattr(self, "channels", None)
        if channels is not None:
            channels.close()
        engine = getattr(self, "engine", None)  # absent when __init__ failed early
        if engine is not None:
            await engine.shutdown()
        drafts = getattr(self, "drafts", None)
        if drafts is not None:
            drafts.close()
