"""The server a load run talks to: found at its URL, or started for the run, and watched.

* `answers(url)`: does `GET /health` answer 200;
* `bare_server(config, log)`: bare mode (`python -m app.standalone`, no Ray) on a free
  127.0.0.1 port for as long as the context lasts, its output in `log`; stopped (SIGTERM,
  then SIGKILL after 30 s) on the way out, also when the run fails;
* `StatusSampler`: a thread that polls `GET /status` every `interval_s` and keeps
  `(wall time, JSON)` pairs (a poll that fails is skipped: the run goes on);
* `scrape(url)`: `GET /metrics` as Prometheus text, or None.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 300.0  # loading the model (and, the first time, building the CPU kernel)


def answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def scrape(url: str) -> str | None:
    try:
        reply = httpx.get(f"{url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return reply.text if reply.status_code == 200 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def bare_server(config: Path, log: Path, root: Path) -> Iterator[str]:
    """Bare mode on a free loopback port, run from `root`; yields its URL once `/health`
    answers. Raises RuntimeError if it exits or does not answer in time."""
    port = free_port()
    command = [sys.executable, "-m", "app.standalone", "--host", "127.0.0.1", "--port", str(port)]
    if config.is_file():
        command += ["--config", str(config)]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not answers(url):
                if process.poll() is not None:
                    raise RuntimeError(f"bare mode exited ({process.returncode}); see {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bare mode did not answer at {url} in time; see {log}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class StatusSampler:
    """Polls `{url}/status` every `interval_s` on its own thread, from `start()` to `stop()`."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-sampler", daemon=True)

    def start(self) -> StatusSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict[str, Any]]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        with httpx.Client(timeout=max(self.interval_s, 1.0)) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    reply = client.get(f"{self.url}/status")
                    if reply.status_code == 200:
                        self.samples.append((time.time(), reply.json()))
                except (httpx.HTTPError, ValueError):
                    pass  # a missed sample is a gap in the plot, not a failed run
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
