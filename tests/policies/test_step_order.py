"""Step-order policies: the key each one gives a sequence (the scheduler's use of it is in
tests/engine/test_scheduler_order.py)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from engine.config import SchedulerConfig
from engine.request import Request, RequestClass
from engine.sched.order import StepOrderPolicy, build_step_order
from engine.sequence import Sequence
from policies.base import create
from policies.step_order import ClassPriority, EarliestDeadline, FirstComeFirstServed

BULK = RequestClass.BULK
INTERACTIVE = RequestClass.INTERACTIVE


def seq(
    arrival: float, cls: RequestClass = INTERACTIVE, deadline: float | None = None, rid: str = "r"
) -> Sequence:
    request = Request(rid, [1, 2], request_class=cls, arrival_time=arrival, deadline=deadline)
    return Sequence.from_request(request)


def served_first(policy: StepOrderPolicy, *seqs: Sequence) -> list[str]:
    """Request ids in the order `policy` serves them (each keyed as if added in turn)."""
    keyed = sorted(seqs, key=lambda s: policy.key(s, seqs.index(s)))
    return [s.request_id for s in keyed]


def test_registered_by_name_and_built_from_the_config():
    assert set(StepOrderPolicy.available()) == {"deadline", "fcfs", "priority"}
    assert isinstance(create(StepOrderPolicy, "fcfs"), FirstComeFirstServed)
    default = build_step_order(SchedulerConfig())
    assert isinstance(default, ClassPriority) and default.aging_s == 30.0
    deadline = build_step_order(
        SchedulerConfig(policy="deadline", interactive_ttft_s=0.5, bulk_ttft_s=9.0)
    )
    assert isinstance(deadline, EarliestDeadline)
    assert deadline.ttft_s == {INTERACTIVE: 0.5, BULK: 9.0}
    with pytest.raises(ValueError, match=r"'nope'.*deadline, fcfs, priority"):
        build_step_order(SchedulerConfig(policy="nope"))


def test_constructor_defaults_are_the_configs():
    config = SchedulerConfig()
    for name in StepOrderPolicy.available():
        cls = type(create(StepOrderPolicy, name))
        params = inspect.signature(cls).parameters
        assert set(params) == set(cls.options)
        for option in cls.options:
            assert params[option].default == getattr(config, option), (name, option)
            assert option in {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_the_key_is_rank_then_arrival_then_add_order():
    policy = ClassPriority(aging_s=None)
    a, b = seq(3.0, BULK, rid="a"), seq(1.0, BULK, rid="b")
    assert policy.key(a, 7) == (math.inf, 3.0, 7)
    assert served_first(policy, a, b) == ["b", "a"]  # same rank: the earlier arrival
    twin = seq(3.0, BULK, rid="twin")
    assert policy.key(a, 0) < policy.key(twin, 1)  # same arrival too: the earlier add


def test_fcfs_is_arrival_order_whatever_the_class():
    policy = FirstComeFirstServed()
    assert not policy.class_aware
    bulk, chat = seq(1.0, BULK, rid="bulk"), seq(2.0, INTERACTIVE, rid="chat")
    assert policy.rank(bulk) == 1.0 and policy.rank(chat) == 2.0
    assert served_first(policy, chat, bulk) == ["bulk", "chat"]


def test_priority_ages_bulk_by_aging_s():
    policy = ClassPriority(aging_s=10.0)
    assert policy.class_aware
    assert policy.rank(seq(5.0, INTERACTIVE)) == 5.0
    assert policy.rank(seq(5.0, BULK)) == 15.0
    # A bulk request that has waited longer than aging_s ranks before one arriving now.
    old_bulk, new_chat = seq(0.0, BULK, rid="old_bulk"), seq(11.0, rid="new_chat")
    assert served_first(policy, new_chat, old_bulk) == ["old_bulk", "new_chat"]
    young_bulk = seq(2.0, BULK, rid="young_bulk")
    assert served_first(policy, young_bulk, new_chat) == ["new_chat", "young_bulk"]


@pytest.mark.parametrize("aging_s", [None, math.inf])
def test_strict_priority_puts_every_interactive_before_any_bulk(aging_s):
    policy = ClassPriority(aging_s=aging_s)
    assert policy.aging_s == math.inf
    early_bulk, late_chat = seq(0.0, BULK, rid="early_bulk"), seq(1e9, rid="late_chat")
    assert served_first(policy, early_bulk, late_chat) == ["late_chat", "early_bulk"]


def test_deadline_is_arrival_plus_the_class_target_or_the_requests_own():
    policy = EarliestDeadline(interactive_ttft_s=1.0, bulk_ttft_s=30.0)
    assert policy.class_aware
    assert policy.rank(seq(10.0, INTERACTIVE)) == 11.0
    assert policy.rank(seq(10.0, BULK)) == 40.0
    assert policy.rank(seq(10.0, BULK, deadline=12.0)) == 12.0  # earlier: it wins
    assert policy.rank(seq(10.0, INTERACTIVE, deadline=50.0)) == 11.0  # later: the target
    # A bulk request arriving 29.5 s before an interactive one is due first.
    bulk, chat = seq(0.0, BULK, rid="bulk"), seq(29.5, rid="chat")
    assert served_first(policy, chat, bulk) == ["bulk", "chat"]


def test_bad_options_and_nan_ranks_are_refused():
    with pytest.raises(ValueError, match="aging_s"):
        ClassPriority(aging_s=-1.0)
    with pytest.raises(ValueError, match="bulk_ttft_s"):
        EarliestDeadline(bulk_ttft_s=math.nan)
    with pytest.raises(ValueError, match="NaN"):
        FirstComeFirstServed().key(seq(math.nan), 0)
