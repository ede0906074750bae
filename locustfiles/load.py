"""`make load`'s locustfile: every kind of user against one server, in steps of load.

    LOAD_STEPS=4,12,24,12,4 LOAD_STEP_S=15 locust -f locustfiles/load.py --headless \
        --host http://127.0.0.1:8000

(`make load` runs it, and also samples the server and writes the report: `locustfiles/run.py`.)

* `ChatUser` (locustfiles/chat.py): short questions, short answers (interactive);
* `PrefixUser`: a long shared system prompt and one of a few fixed knowledge-base articles
  before the question, so the prompt's first ~800 tokens repeat across requests and prefix
  caching decides its TTFT;
* `FlexUser`: bulk work (`service_tier: "flex"`), long outputs (`ignore_eos`, 384 tokens);
* `DropUser`: streams a question and closes the connection after a few chunks, as a person
  who pressed stop (the server should abort it and count it cancelled);
* `StepLoad`: the users go up and back down in steps (`LOAD_STEPS`, each held `LOAD_STEP_S`
  seconds), then the run stops.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from locust import LoadTestShape, between, task

if __package__ != "locustfiles":  # `locust -f` loaded this file by path: find the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locustfiles.chat import ChatUser
from locustfiles.common import StreamingUser
from locustfiles.prompts import ARTICLES, QUESTIONS, rag_messages
from locustfiles.settings import LoadSettings

__all__ = ["ChatUser", "DropUser", "FlexUser", "PrefixUser", "StepLoad"]


class PrefixUser(StreamingUser):
    weight = 3
    wait_time = between(0.5, 2.0)

    @task
    def ask_with_context(self) -> None:
        self.stream(rag_messages(random.randrange(ARTICLES), random.choice(QUESTIONS)))


class FlexUser(StreamingUser):
    weight = 2
    wait_time = between(0.5, 1.5)
    service_tier = "flex"
    max_tokens = 384
    ignore_eos = True

    @task
    def summarize(self) -> None:
        question = random.choice(QUESTIONS)
        self.stream(rag_messages(random.randrange(ARTICLES), question))


class DropUser(StreamingUser):
    weight = 1
    wait_time = between(1.0, 3.0)
    max_tokens = 256
    ignore_eos = True

    @task
    def ask_and_leave(self) -> None:
        self.stream([{"role": "user", "content": random.choice(QUESTIONS)}], drop_after=4)


class StepLoad(LoadTestShape):
    """Users in steps, up and back down (`LOAD_STEPS`, `LOAD_STEP_S`); None ends the run."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = LoadSettings()

    def tick(self) -> tuple[int, float] | None:
        users = self.settings.users_at(self.get_run_time())
        return None if users is None else (users, self.settings.spawn_rate)
