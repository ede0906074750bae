"""Locust users that stream chat completions and record client-side TTFT, ITL and TPOT.

    locust -f locustfiles/chat.py --host http://127.0.0.1:8000 --headless -u 8 -r 4 -t 60s

Each streamed request reports three extra entries in Locust's statistics: `ttft` (request
start to the first content chunk), `itl` (every gap between content chunks) and `tpot`
((last - first) / (chunks - 1)), all in milliseconds. `BulkUser` sends the same traffic
marked as bulk (`service_tier: "flex"`), so mixed runs show how interactive latency holds
while bulk work shares the fleet. Only ever point it at a server you run on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import json
import random
import time

from locust import HttpUser, between, task

QUESTIONS = (
    "Can I pause my annual subscription?",
    "How do I reset my password?",
    "Why was I charged twice this month?",
    "Where can I download my invoices?",
    "How do I export all of my data?",
    "Could you help me change the email on my account, please?",
)


class ChatUser(HttpUser):
    weight = 3
    wait_time = between(0.5, 2.0)
    service_tier: str | None = None

    def _body(self) -> dict:
        body = {
            "model": "demo",
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": random.choice(QUESTIONS)}],
        }
        if self.service_tier:
            body["service_tier"] = self.service_tier
        return body

    def _record(self, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type="SSE", name=name, response_time=ms, response_length=0, exception=None
        )

    @task
    def stream_chat(self) -> None:
        start = time.perf_counter()
        stamps: list[float] = []
        with self.client.post(
            "/v1/chat/completions", json=self._body(), stream=True, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    resp.failure(chunk["error"].get("message", "stream error"))
                    return
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
            resp.success()
        if not stamps:
            return
        tier = self.service_tier or "interactive"
        self._record(f"ttft[{tier}]", 1000 * (stamps[0] - start))
        for a, b in itertools.pairwise(stamps):
            self._record(f"itl[{tier}]", 1000 * (b - a))
        if len(stamps) > 1:
            self._record(f"tpot[{tier}]", 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))


class BulkUser(ChatUser):
    weight = 1
    service_tier = "flex"
