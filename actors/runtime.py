"""Small facts about the process a deployment runs in, and its logging."""

from __future__ import annotations

import logging
import os
import uuid

from ray import serve


def replica_id() -> str:
    """This Serve replica's unique id (a random one outside Serve, e.g. in unit tests)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


def deployment_name() -> tuple[str | None, str]:
    """(application, deployment) of this Serve replica ((None, "") outside Serve)."""
    try:
        context = serve.get_replica_context()
    except Exception:
        return None, ""
    return context.app_name, context.deployment


def node_id() -> str:
    """The Ray node this process runs on (a random id outside Ray, e.g. in unit tests)."""
    import ray

    if not ray.is_initialized():  # asking the runtime context would start a local Ray
        return uuid.uuid4().hex
    return ray.get_runtime_context().get_node_id()


def node_ip() -> str:
    """The address other Ray nodes reach this node at ("127.0.0.1" outside Ray)."""
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def renice(increment: int) -> None:
    """Make every thread of this process `increment` nicer (at most 19), and so the threads
    they start later. On Linux niceness is per thread (`os.nice` changes only the caller's),
    and a Ray worker already runs a dozen threads (gRPC, the core worker's) when a
    deployment's constructor runs. Raising niceness needs no privilege."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the process-wide call
        os.nice(increment)
        return
    for tid in tids:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
        except OSError:  # the thread ended meanwhile
            pass


OUR_LOGGERS = ("firstlight", "engine")  # every logger of this project is below one of these


def route_logs() -> None:
    """Send this project's log records where Serve sends its own in this process: the
    replica's log file and the console, in Serve's format (with the replica's id), at
    Serve's level. Without it they reach no handler in a Serve worker: INFO lines vanish and
    warnings go out bare, without time, level or replica. Idempotent; call it first in a
    deployment's constructor. Outside a Serve replica (a deployment class built in a test,
    say) it does nothing."""
    if deployment_name()[0] is None:
        return
    serve_logger = logging.getLogger("ray.serve")
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        for handler in serve_logger.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.setLevel(serve_logger.getEffectiveLevel())
        logger.propagate = False  # not twice (a root handler, were one added)
