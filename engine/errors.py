"""The engine's typed refusals: what a caller may see before a request's first token.

Each maps to one HTTP answer at the edge (`app/errors.py`) and crosses the replica → ingress
hop as data (`actors/messages.ReplicaError`), never as a formatted traceback:

    InvalidRequest(param, message)   400, naming the parameter
    QueueFull(message, retry_after_s) 429 with Retry-After
    Unavailable(message)             503: no engine can take the request now
"""

from __future__ import annotations


class InvalidRequest(Exception):
    """The request can never be served as sent; `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str | None, str]]:
        return (type(self), (self.param, self.message))


class QueueFull(Exception):
    """No room now; the caller may retry after `retry_after_s` seconds."""

    def __init__(self, message: str = "server overloaded", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float]]:
        return (type(self), (str(self), self.retry_after_s))


class Unavailable(Exception):
    """No engine can take the request right now (none started, all replicas gone)."""
