"""Small facts about the process a deployment runs in."""

from __future__ import annotations

import os
import uuid

from ray import serve


def replica_id() -> str:
    """This Serve replica's unique id (a random one outside Serve, e.g. in unit tests)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


def rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
