"""`make load`'s settings, from `LOAD_*` environment variables (pydantic-settings).

The driver (`locustfiles/run.py`) and the Locust process (its step shape) read the same
class, so a value set once in the environment reaches both. Unknown `LOAD_*` variables are
ignored (the environment is shared with everything else); bad values are errors naming the
field.

The step plan: `steps` users, each count held `step_s` seconds, so the run lasts
`len(steps) * step_s` seconds and then stops (Locust's `--run-time` is not used: the shape
ends the run). Per-class SLOs are in milliseconds; a request meets its class's SLO when its
TTFT and its TPOT are both within them (a one-token answer has no TPOT and meets that half).
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_address
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CLASSES = ("interactive", "flex")  # the client's service tiers; flex is the server's `bulk`
SERVER_CLASS = {"interactive": "interactive", "flex": "bulk"}


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def met(self, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        if ttft_ms is None or ttft_ms > self.ttft_ms:
            return False
        return tpot_ms is None or tpot_ms <= self.tpot_ms


class LoadSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOAD_", extra="ignore", frozen=True)

    host: str = "http://127.0.0.1:8000"  # a server on this machine only (loopback)
    model: str = "demo"  # what the users send as `model`
    steps: str = "4,12,24,12,4"  # users per step, comma-separated
    step_s: float = Field(15.0, gt=0, le=600)  # how long each step is held
    spawn_rate: float = Field(4.0, gt=0)  # users started (or stopped) per second
    out: str = ""  # report folder; empty: bench/out/load-<time>
    start_server: bool = True  # no server answering: run bare mode for the run's length
    config: str = "serve_config.yaml"  # the config bare mode reads when it is started here
    window_s: float = Field(0.0, ge=0)  # report's time bins; 0: about 20 over the run
    sample_s: float = Field(1.0, gt=0)  # how often /status is polled during the run
    slo_interactive_ttft_ms: float = Field(250.0, gt=0)
    slo_interactive_tpot_ms: float = Field(40.0, gt=0)
    slo_flex_ttft_ms: float = Field(2000.0, gt=0)
    slo_flex_tpot_ms: float = Field(100.0, gt=0)

    @field_validator("host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        """Load is only ever sent to this machine: a typo must not load someone else's."""
        url = urlsplit(value)
        host = url.hostname or ""
        local = host == "localhost"
        if not local:
            try:
                local = ip_address(host).is_loopback
            except ValueError:
                local = False
        if url.scheme not in ("http", "https") or not local:
            raise ValueError(f"{value!r}: expected http://127.0.0.1:PORT (loopback only)")
        return value.rstrip("/")

    @field_validator("steps")
    @classmethod
    def _user_counts(cls, value: str) -> str:
        counts = [part.strip() for part in value.split(",")]
        if not counts or not all(c.isdigit() for c in counts) or max(map(int, counts)) == 0:
            raise ValueError(f"{value!r}: expected user counts like 4,12,24,12,4")
        return value

    def user_steps(self) -> list[int]:
        return [int(part) for part in self.steps.split(",")]

    def duration_s(self) -> float:
        return len(self.user_steps()) * self.step_s

    def slos(self) -> dict[str, SLO]:
        return {
            "interactive": SLO(self.slo_interactive_ttft_ms, self.slo_interactive_tpot_ms),
            "flex": SLO(self.slo_flex_ttft_ms, self.slo_flex_tpot_ms),
        }

    def users_at(self, run_time_s: float) -> int | None:
        """Users wanted `run_time_s` into the run; None once the last step is over."""
        index = int(run_time_s // self.step_s)
        steps = self.user_steps()
        return steps[index] if index < len(steps) else None
