"""A request's times cross hosts: `arrival_time` and `deadline` move onto the receiver's
monotonic clock (another host's counts from another boot)."""

from __future__ import annotations

import time

import pytest

from engine.request import Request, clock_base

OTHER_HOST = 4.2e6  # the sender's host booted 7 weeks before this one


def test_times_stamped_on_another_hosts_clock_move_onto_this_one():
    now_there = time.monotonic() + OTHER_HOST
    request = Request(
        "r", [1, 2], arrival_time=now_there - 0.25, deadline=now_there + 30.0,
        sender_clock=clock_base() + OTHER_HOST,
    )  # fmt: skip
    request.to_local_clock()
    now = time.monotonic()
    assert request.arrival_time == pytest.approx(now - 0.25, abs=0.05)  # arrived 0.25 s ago
    assert request.deadline == pytest.approx(now + 30.0, abs=0.05)
    assert request.sender_clock is None
    arrival = request.arrival_time
    request.to_local_clock()  # already local: nothing moves
    assert request.arrival_time == arrival


def test_a_request_that_never_left_its_process_keeps_its_times():
    request = Request("r", [1], arrival_time=12.5)
    request.to_local_clock()
    assert (request.arrival_time, request.deadline) == (12.5, None)
