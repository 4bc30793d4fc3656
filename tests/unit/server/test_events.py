"""``serving.events``: every subscriber hears each event, in order, whatever another one does."""

from __future__ import annotations

import logging

import pytest

from hosted_tinker.core.checkpoints import TinkerPath
from hosted_tinker.server.serving.events import CheckpointEvents, Deleted

pytestmark = pytest.mark.fast


def test_a_failing_subscriber_is_logged_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    events, heard = CheckpointEvents(), []
    event = Deleted(TinkerPath("run", "weights", "x"), actor="key-a")

    def broken(_: Deleted) -> None:
        raise RuntimeError("mirror queue gone")

    events.deleted.subscribe(lambda e: heard.append(("first", e)))
    events.deleted.subscribe(broken)
    events.deleted.subscribe(lambda e: heard.append(("last", e)))
    with caplog.at_level(logging.ERROR):
        events.deleted(event)  # the deletion happened: nothing is raised to the request that made it
    assert heard == [("first", event), ("last", event)]
    assert "a subscriber to checkpoint deleted failed" in caplog.text
    events.made(object())  # a topic nobody subscribed to: nothing happens
