"""``core.throttle``: a warning a flood would repeat is let through once per interval, counted."""

from __future__ import annotations

import pytest

from hosted_tinker.core.throttle import Throttle

pytestmark = pytest.mark.fast


def test_events_are_let_through_once_an_interval_with_their_count():
    now = [100.0]
    throttle = Throttle(10.0, clock=lambda: now[0])
    assert throttle.due() == 1  # the first at once
    assert [throttle.due() for _ in range(3)] == [0, 0, 0]
    now[0] += 9.9
    assert throttle.due() == 0
    now[0] += 0.1
    assert throttle.due() == 5  # the four held back and this one
    now[0] += 10.0
    assert throttle.due() == 1
