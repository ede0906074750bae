"""Locust users that stream chat completions and record client-side TTFT, ITL and TPOT.

    locust -f locustfiles/chat.py --host http://127.0.0.1:8000 --headless -u 8 -r 4 -t 60s

Each streamed request reports extra entries in Locust's statistics (`ttft[tier]`,
`itl[tier]`, `tpot[tier]`, `e2e[tier]`, in milliseconds; see `locustfiles/common.py`).
`BulkUser` sends the same traffic marked as bulk (`service_tier: "flex"`), so mixed runs show
how interactive latency holds while bulk work shares the fleet. Only ever point it at a
server you run on 127.0.0.1. `make load` (`locustfiles/load.py`) runs these users with the
others and a step shape, and writes a report.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from locust import between, task

if __package__ != "locustfiles":  # `locust -f` loaded this file by path: find the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locustfiles.common import StreamingUser
from locustfiles.prompts import QUESTIONS


class ChatUser(StreamingUser):
    """A person chatting: a short question, an answer of up to 64 tokens, a pause."""

    weight = 3
    wait_time = between(0.5, 2.0)

    @task
    def ask(self) -> None:
        self.stream([{"role": "user", "content": random.choice(QUESTIONS)}])


class BulkUser(ChatUser):
    """The same questions as bulk work (`service_tier: "flex"`)."""

    weight = 1
    service_tier = "flex"
