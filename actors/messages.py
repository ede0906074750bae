"""Messages of the token-path boundary (ModelReplica → ingress), besides `TokenDelta`, and
the replica's typed stats.

A request the engine refuses before its first token (bad request, full queue, dead engine)
comes back as one `ReplicaError` item instead of a raised exception: a typed value crosses
the actor hop intact and cheaply, where a raised one would arrive as a `RayTaskError` with a
formatted traceback. `ReplicaError.exception()` rebuilds what the local engine would have
raised, so the HTTP layer answers 400 / 429 / 503 exactly as in bare mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine.errors import InvalidRequest, QueueFull, Unavailable
from engine.stats import EngineStats


class ErrorKind(StrEnum):
    INVALID = "invalid"  # InvalidRequest(param, message) → 400
    QUEUE_FULL = "queue_full"  # QueueFull → 429 + Retry-After
    UNAVAILABLE = "unavailable"  # the engine cannot serve (its loop died) → 503


@dataclass(slots=True, frozen=True)
class ReplicaError:
    kind: ErrorKind
    message: str
    param: str | None = None
    retry_after_s: float = 1.0

    @classmethod
    def from_exception(cls, exc: Exception) -> ReplicaError:
        if isinstance(exc, QueueFull):
            return cls(ErrorKind.QUEUE_FULL, str(exc), retry_after_s=exc.retry_after_s)
        if isinstance(exc, InvalidRequest):
            return cls(ErrorKind.INVALID, exc.message, param=exc.param)
        return cls(ErrorKind.UNAVAILABLE, str(exc) or type(exc).__name__)

    def exception(self) -> Exception:
        if self.kind is ErrorKind.QUEUE_FULL:
            return QueueFull(self.message, retry_after_s=self.retry_after_s)
        if self.kind is ErrorKind.INVALID:
            return InvalidRequest(self.param, self.message)
        return Unavailable(self.message)


@dataclass(slots=True, frozen=True)
class ReplicaInfo:
    """What an ingress needs to know about the model a replica serves. The ingress loads its
    tokenizer on its own node (`engine.model` resolved there) and checks it against
    `tokenizer_digest`: `model_path` may exist only on the replica's node."""

    replica_id: str
    model: str  # the served model name
    model_path: str  # its weights and tokenizer, on the replica's node (for logs only)
    max_model_len: int
    tokenizer_digest: str  # `engine.tokenizer.tokenizer_digest` of the replica's tokenizer


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    """`ModelReplica.stats()`: its engine's stats plus what only the replica process knows."""

    replica_id: str
    rss_bytes: int  # resident memory of the replica process
    engine: EngineStats
