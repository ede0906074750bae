"""Which class (interactive | bulk) an incoming HTTP request belongs to.

Interactive requests are scheduled first; bulk ones fill the rest of each step and are
preempted first when the KV pool is full. The ingress asks the configured policy once per
request, before tokenization, so a policy must be cheap and must not block.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequest
from engine.request import RequestClass
from policies.base import Policy, register

CLASS_HEADER = "x-firstlight-class"
BULK_SERVICE_TIERS = frozenset({"flex", "batch"})


class RequestClassPolicy(Policy, family=True):
    """Classify one request.

    `headers` is looked up with lower-case names (a case-insensitive mapping such as
    Starlette's `Headers`, or a dict with lower-case keys); `body` is the parsed JSON body.
    An invalid explicit choice raises `ValueError(param, message)` (the HTTP layer answers 400).
    """

    @abstractmethod
    def classify(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> RequestClass: ...


def _parse_class(value: str, param: str) -> RequestClass:
    try:
        return RequestClass(value.strip().lower())
    except ValueError:
        choices = ", ".join(c.value for c in RequestClass)
        raise InvalidRequest(param, f"{param} must be one of: {choices} (got {value!r})") from None


@register("header")
class HeaderOrServiceTier(RequestClassPolicy):
    """The `x-firstlight-class` header wins; else `service_tier` "flex"/"batch" means bulk;
    else `default`."""

    def __init__(self, default: str = RequestClass.INTERACTIVE.value) -> None:
        self.default = _parse_class(default, "default")

    def classify(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> RequestClass:
        explicit = headers.get(CLASS_HEADER)
        if explicit:
            return _parse_class(explicit, CLASS_HEADER)
        tier = body.get("service_tier")
        if isinstance(tier, str) and tier.lower() in BULK_SERVICE_TIERS:
            return RequestClass.BULK
        return self.default


@register("fixed")
class FixedClass(RequestClassPolicy):
    """Every request gets the same class (e.g. a deployment that only serves batch work)."""

    def __init__(self, request_class: str = RequestClass.INTERACTIVE.value) -> None:
        self.request_class = _parse_class(request_class, "request_class")

    def classify(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> RequestClass:
        return self.request_class
