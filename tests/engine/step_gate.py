"""`StepGate`: holds a real engine's thread before each step until opened, so a test can
fill the waiting queue deterministically while the engine itself stays real."""

from __future__ import annotations

import threading

from engine.llm_engine import LLMEngine


class StepGate:
    def __init__(self, engine: LLMEngine) -> None:
        self._open = threading.Event()
        real_step = engine.step

        def gated_step(*args, **kwargs):
            self._open.wait()
            return real_step(*args, **kwargs)

        engine.step = gated_step  # type: ignore[method-assign]

    def open(self) -> None:
        self._open.set()


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
