"""Which resident model is parked to make room (``serving.residency.fair_victim``): the least
recently used model of the tenant holding the most, the incoming model counted for its owner."""

from __future__ import annotations

import pytest

from hosted_tinker.server.serving.residency import fair_victim

pytestmark = pytest.mark.fast

OWNERS = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C"}


def victim(used: dict[str, float], incoming_owner: str) -> str:
    return fair_victim(list(used), used, OWNERS.__getitem__, incoming_owner)


def test_the_tenant_holding_most_gives_up_its_least_recently_used() -> None:
    assert victim({"a1": 1.0, "b1": 0.0, "b2": 2.0}, "C") == "b1"
    assert victim({"a1": 0.0, "b1": 1.0, "b2": 2.0}, "C") == "b1"  # not a1, the oldest of all


def test_the_incoming_model_counts_for_its_owner() -> None:
    assert victim({"a1": 5.0, "b1": 3.0}, "A") == "a1"  # A would hold two
    assert victim({"a1": 5.0, "b1": 3.0, "c1": 1.0}, "A") == "a1"


def test_a_tie_goes_to_the_tenant_with_the_oldest_use() -> None:
    assert victim({"a1": 5.0, "b1": 3.0}, "C") == "b1"
    assert victim({"a1": 2.0, "a2": 9.0, "b1": 3.0, "b2": 4.0}, "C") == "a1"
