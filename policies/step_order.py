"""Step-order policies (the family is `engine.sched.order.StepOrderPolicy`).

* `fcfs`: arrival order, classes alike (what most engines do): one admission line and no
  bulk reserve.
* `priority` (default): interactive before bulk, with aging: a bulk request ranks as if it
  had arrived `aging_s` later, so one that has waited `aging_s` ranks with an interactive
  request arriving now, and bulk cannot be starved in latency either. `aging_s=None` (or
  `inf`) is strict priority: every interactive request before any bulk one.
* `deadline`: earliest deadline first. A request's deadline is its arrival plus its class's
  time-to-first-token target (`interactive_ttft_s`, `bulk_ttft_s`), or `Request.deadline`
  when that is earlier.
"""

from __future__ import annotations

import math

from engine.request import RequestClass
from engine.sched.order import StepOrderPolicy
from engine.sequence import Sequence
from policies.base import register


def _non_negative(name: str, value: float) -> float:
    if not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


@register("fcfs")
class FirstComeFirstServed(StepOrderPolicy):
    class_aware = False

    def rank(self, seq: Sequence) -> float:
        return seq.request.arrival_time


@register("priority")
class ClassPriority(StepOrderPolicy):
    options = ("aging_s",)

    def __init__(self, aging_s: float | None = 30.0) -> None:
        self.aging_s = math.inf if aging_s is None else _non_negative("aging_s", aging_s)

    def rank(self, seq: Sequence) -> float:
        request = seq.request
        if request.request_class is RequestClass.BULK:
            return request.arrival_time + self.aging_s
        return request.arrival_time


@register("deadline")
class EarliestDeadline(StepOrderPolicy):
    options = ("interactive_ttft_s", "bulk_ttft_s")

    def __init__(self, interactive_ttft_s: float = 1.0, bulk_ttft_s: float = 30.0) -> None:
        self.ttft_s = {
            RequestClass.INTERACTIVE: _non_negative("interactive_ttft_s", interactive_ttft_s),
            RequestClass.BULK: _non_negative("bulk_ttft_s", bulk_ttft_s),
        }

    def rank(self, seq: Sequence) -> float:
        request = seq.request
        target = request.arrival_time + self.ttft_s[request.request_class]
        return target if request.deadline is None else min(target, request.deadline)
