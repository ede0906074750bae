"""The step order: which sequences the step scheduler serves first.

The family lives with the engine (the scheduler asks it once per sequence); its policies live
in `policies/step_order.py` and are chosen by name (`SchedulerConfig.policy`).

A policy ranks a sequence once, when the scheduler takes it in, and the scheduler stores its
key, `(rank, arrival_time, serial)`, on the sequence (`Sequence.order_key`): lower is served
first, ties go to the earlier arrival, then to the earlier `add`. The key never changes while
the sequence lives, and every decision of a step follows it (engine/sched/scheduler.py):
running sequences get their chunks and waiting ones are admitted in key order, a sequence
preempts only running ones with a worse key, and a preempted sequence goes back into the
waiting queue at its key's place. Because keys are fixed, a victim never preempts the
sequence that displaced it.

`class_aware` says whether the order tells the request classes apart. For such an order the
scheduler keeps bulk's reserved share of budget and seats (`SchedulerConfig.bulk_min_share`,
a starvation guard) and admits each class in its own line (a class whose next sequence does
not fit does not hold up the other); an order that treats classes alike gets one line and no
reserve.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import ClassVar

from engine.config import SchedulerConfig
from engine.sequence import Sequence
from policies.base import Policy, lookup

OrderKey = tuple[float, float, int]  # (rank, arrival_time, serial): lower is served first


class StepOrderPolicy(Policy, family=True):
    """Ranks sequences for the step scheduler; see the module docstring for the contract."""

    # Whether the bulk reserve and one admission line per class apply.
    class_aware: ClassVar[bool] = True
    # The `SchedulerConfig` fields passed to the constructor as keyword arguments.
    options: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def rank(self, seq: Sequence) -> float:
        """The sequence's rank, from its request alone (it is asked once, at `add`): lower is
        served first; `inf` ranks after every finite rank; never NaN."""

    def key(self, seq: Sequence, serial: int) -> OrderKey:
        """The key the scheduler stores on `seq`; `serial` counts its `add` calls."""
        rank = self.rank(seq)
        if math.isnan(rank):
            raise ValueError(f"{type(self).__name__} ranked {seq.request_id!r} NaN")
        return (rank, seq.request.arrival_time, serial)


def build_step_order(config: SchedulerConfig) -> StepOrderPolicy:
    """The policy `config.policy` names, given the config fields it lists in `options`.

    An unknown name is a `ValueError` listing the known ones."""
    import policies.step_order  # noqa: F401  # registers the policies

    cls = lookup(StepOrderPolicy, config.policy)
    return cls(**{name: getattr(config, name) for name in cls.options})
