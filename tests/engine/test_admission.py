"""The one admission decision: the class rule, and Retry-After from a measured drain rate
(with a fake clock)."""

from __future__ import annotations

import pytest

from engine.errors import QueueFull
from engine.request import RequestClass
from engine.sched.admission import Admission, DrainMeter, has_room, retry_after_s
from engine.stats import AdmissionStats, ClassCounts
from tests.engine.step_gate import FakeClock

INTERACTIVE, BULK = RequestClass.INTERACTIVE, RequestClass.BULK


def test_bulk_stops_short_of_the_interactive_reserve_interactive_uses_it_all():
    admission = Admission(8, interactive_reserve=2)
    admission.check(BULK, ClassCounts(bulk=5))
    with pytest.raises(QueueFull):
        admission.check(BULK, ClassCounts(bulk=6))  # 2 places left: interactive's
    admission.check(INTERACTIVE, ClassCounts(bulk=6))
    admission.check(INTERACTIVE, ClassCounts(interactive=1, bulk=6))
    with pytest.raises(QueueFull):
        admission.check(INTERACTIVE, ClassCounts(interactive=2, bulk=6))  # full
    with pytest.raises(QueueFull):
        admission.check(BULK, ClassCounts(interactive=6))  # interactive load counts too


def test_a_bulk_flood_never_refuses_interactive_while_room_remains():
    for max_waiting in (1, 2, 3, 8, 512):
        admission = Admission(max_waiting)
        waiting = ClassCounts()
        while has_room(BULK, waiting, max_waiting, admission.interactive_reserve):
            waiting = waiting.plus(BULK, 1)
        assert waiting.bulk == max_waiting - admission.interactive_reserve
        assert waiting.bulk >= 1  # bulk always has a place
        while waiting.total < max_waiting:
            admission.check(INTERACTIVE, waiting)
            waiting = waiting.plus(INTERACTIVE, 1)
        with pytest.raises(QueueFull):
            admission.check(INTERACTIVE, waiting)


def test_default_reserve_is_a_quarter_and_bad_bounds_are_refused():
    assert Admission(512).interactive_reserve == 128
    assert Admission(2).interactive_reserve == 1
    assert Admission(1).interactive_reserve == 0
    with pytest.raises(ValueError):
        Admission(0)
    with pytest.raises(ValueError):
        Admission(4, interactive_reserve=4)
    with pytest.raises(ValueError):
        Admission(4, min_retry_after_s=5.0, max_retry_after_s=2.0)


def test_drain_rate_over_the_window_with_a_fake_clock():
    clock = FakeClock(100.0)
    meter = DrainMeter(window_s=10.0, clock=clock)
    assert meter.rate_per_s() is None
    for _ in range(5):  # one finish every 0.5 s: 2 per second
        meter.record()
        clock.advance(0.5)
    clock.advance(-0.5)  # observed at the last finish
    assert meter.rate_per_s() == pytest.approx(2.0)
    clock.advance(2.0)  # nothing finishes: the rate decays
    assert meter.rate_per_s() == pytest.approx(4 / 4.0)
    clock.advance(20.0)  # everything left the window
    assert meter.rate_per_s() is None


def test_retry_after_is_the_queue_ahead_over_the_drain_rate_clamped():
    clock = FakeClock()
    admission = Admission(10, interactive_reserve=4, clock=clock)
    assert admission.retry_after_s(BULK, ClassCounts(bulk=6)) == 1.0  # no rate yet: the floor
    for _ in range(3):  # finishes at t = 0, 4, 8: 0.25 per second
        admission.record_finished()
        clock.advance(4.0)
    clock.advance(-4.0)
    waiting = ClassCounts(interactive=2, bulk=6)
    with pytest.raises(QueueFull) as info:
        admission.check(BULK, waiting)
    assert info.value.retry_after_s == pytest.approx(8 / 0.25)  # every waiting one is ahead
    assert admission.retry_after_s(INTERACTIVE, waiting) == pytest.approx(2 / 0.25)
    assert admission.retry_after_s(BULK, ClassCounts(bulk=100)) == 60.0  # the ceiling
    admission.record_finished(1000)  # a burst of finishes at t = 8
    clock.advance(0.001)
    assert admission.retry_after_s(BULK, waiting) == 1.0
    assert admission.stats() == AdmissionStats(10, 4, admission.drain.rate_per_s())


def test_retry_after_function_handles_unknown_rates():
    assert retry_after_s(50, None) == 1.0
    assert retry_after_s(50, 0.0) == 1.0
    assert retry_after_s(50, 10.0) == 5.0
    assert retry_after_s(0, 10.0, lo=0.5) == 0.5
