"""One streamed request as the client saw it: the record the Locust users write, one JSON
line each, and the report reads. Plain Python (no Locust), so the report and its tests never
import Locust (whose import monkey-patches the whole process for gevent).

Latencies follow the server's definitions (`app/metrics.py`), measured at the client:
TTFT = request sent → first content chunk received; ITL = the gaps between content chunks;
TPOT = (last − first chunk) / (completion tokens − 1), the token count from the final usage
chunk (a chunk may carry several tokens), else the number of chunks.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from typing import Literal

Outcome = Literal["ok", "dropped", "error"]


@dataclass(frozen=True, slots=True)
class StreamRecord:
    start: float  # wall-clock seconds (time.time()) when the request was sent
    user: str  # the Locust user class that sent it
    tier: str  # interactive | flex
    outcome: Outcome  # ok: read to the end; dropped: the client left on purpose; error
    chunks_ms: tuple[float, ...]  # arrival of each content chunk, ms after `start`
    end_ms: float  # when the client was done with it (last byte, drop or error)
    tokens: int | None = None  # completion tokens from the usage chunk, if it came
    error: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return self.chunks_ms[0] if self.chunks_ms else None

    def itl_ms(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunks_ms)]

    @property
    def tpot_ms(self) -> float | None:
        tokens = self.tokens if self.tokens is not None else len(self.chunks_ms)
        if len(self.chunks_ms) < 2 or tokens < 2:
            return None
        return (self.chunks_ms[-1] - self.chunks_ms[0]) / (tokens - 1)

    @property
    def end(self) -> float:
        """Wall-clock seconds when the client was done with it."""
        return self.start + self.end_ms / 1000

    def to_json(self) -> str:
        data = asdict(self)
        data["chunks_ms"] = [round(t, 3) for t in self.chunks_ms]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StreamRecord:
        data = json.loads(line)
        data["chunks_ms"] = tuple(data["chunks_ms"])
        return cls(**data)
