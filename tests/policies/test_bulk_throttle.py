"""The cluster bulk throttle: bulk runs only in the capacity interactive traffic leaves."""

from __future__ import annotations

import pytest

from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats
from policies.base import create
from policies.bulk_throttle import (
    UNLIMITED,
    BulkThrottle,
    RecentMax,
    SpareCapacity,
    bulk_in_engines,
    bulk_room,
)


def stats(
    interactive: int = 0,
    bulk: int = 0,
    waiting_interactive: int = 0,
    seats: int = 32,
    taken_interactive: int = 0,
):
    return EngineStats(
        model="m",
        running=ClassCounts(interactive, bulk),
        waiting=ClassCounts(waiting_interactive, 0),
        kv=KVStats(100, 50, 0.5, 0, 0),
        admission=AdmissionStats(128, 32, None, max_running=seats),
        num_requests=ClassCounts(taken_interactive, 0),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_replica_lends_every_seat_and_a_queue_a_busy_one_a_share():
    clock = Clock()
    throttle = SpareCapacity(busy_share=0.125, hold_s=5.0, clock=clock)  # queue_ahead 1/8
    assert throttle.allowance({"a": stats(), "b": stats()}) == 2 * (32 + 4)
    # a serves chats: 4 of its seats (1/8 of 32), none to queue; b, serving none, still
    # lends all 32 and 4 to wait in its queue
    assert throttle.allowance({"a": stats(interactive=3), "b": stats(bulk=10)}) == 4 + 36
    # chats gone from the snapshot, but seen 1 s ago: a stays in the busy share
    clock.now = 1.0
    assert throttle.allowance({"a": stats(), "b": stats()}) == 4 + 36
    clock.now = 6.0
    assert throttle.allowance({"a": stats(), "b": stats()}) == 72
    assert SpareCapacity(queue_ahead=0.0).allowance({"a": stats()}) == 32
    assert SpareCapacity(queue_ahead=0.5).allowance({"a": stats(seats=5)}) == 8  # rounds up


def test_chats_that_came_and_went_between_two_snapshots_count_as_serving_chat():
    clock = Clock()
    throttle = SpareCapacity(busy_share=0.125, hold_s=5.0, queue_ahead=0.0, clock=clock)
    assert throttle.allowance({"a": stats(taken_interactive=7)}) == 32  # first look: history
    clock.now = 1.0  # no chat running in either snapshot, but two were taken in between
    assert throttle.allowance({"a": stats(taken_interactive=9)}) == 4
    clock.now = 5.5
    assert throttle.allowance({"a": stats(taken_interactive=9)}) == 4  # held
    clock.now = 6.5
    assert throttle.allowance({"a": stats(taken_interactive=9)}) == 32
    # a replacement replica under the same id starts counting again: a change, not a drop
    assert throttle.allowance({"a": stats(taken_interactive=1)}) == 4


def test_bulk_never_takes_seats_interactive_holds_and_always_moves():
    throttle = SpareCapacity(busy_share=0.5, hold_s=0.0, clock=Clock())
    assert throttle.allowance({"a": stats(interactive=30)}) == 2  # 32 - 30 < 16
    assert throttle.allowance({"a": stats(interactive=32, waiting_interactive=5)}) == 1  # floor
    assert throttle.allowance({}) == 1


def test_unlimited_and_the_registry():
    assert create(BulkThrottle, "unlimited").allowance({"a": stats()}) == UNLIMITED
    assert isinstance(create(BulkThrottle, "spare_capacity"), SpareCapacity)
    with pytest.raises(ValueError):
        SpareCapacity(busy_share=2.0)
    with pytest.raises(ValueError, match="queue_ahead"):
        SpareCapacity(queue_ahead=-0.1)
    assert bulk_in_engines({"a": stats(bulk=3), "b": stats(bulk=4)}) == 7


def test_recent_max_keeps_the_peak_of_its_window():
    clock = Clock()
    recent = RecentMax(2.0, clock=clock)
    assert recent.note(5) == 5
    clock.now = 1.0
    assert recent.note(3) == 5
    clock.now = 2.5  # the 5 is older than the window now
    assert recent.note(4) == 4
    clock.now = 10.0
    assert recent.note(0) == 0


def test_a_caller_whose_requests_just_finished_keeps_their_places():
    """The view still shows this caller's 20 finished requests; they are not someone else's."""
    throttle = SpareCapacity(hold_s=0.0, queue_ahead=0.0, clock=Clock())
    view = {"a": stats(bulk=32)}  # reported while this caller had 32 in flight
    assert bulk_room(throttle, view, own=12) == 0  # taken as 20 of someone else's
    assert bulk_room(throttle, view, own=12, own_reported=32) == 20
    assert bulk_room(throttle, {"a": stats(bulk=40)}, own=12, own_reported=32) == 12  # 8 others
