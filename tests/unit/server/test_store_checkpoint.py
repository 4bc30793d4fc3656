"""``quotas.store_checkpoint``: how every save, copy and upload stores a checkpoint under the key's
reserved checkpoint bytes — refused before anything is written, and never leaving bytes held
or files behind, however it ends."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.quotas import Reservation, store_checkpoint

pytestmark = pytest.mark.fast


def reservation(stored: int, limit: int | None = 100, held: int = 0) -> Reservation:
    quotas = SimpleNamespace(_checkpoints=threading.Lock(), _stored=lambda tenant: stored, _reserved={})
    if held:
        quotas._reserved["alice"] = held
    return Reservation(quotas, "alice", limit, held)  # type: ignore[arg-type]


def run(
    held: Reservation | None,
    size: int,
    *,
    fail: str = "",
    replaces: int = 0,
    done: list[str] | None = None,
) -> list[str]:
    done = [] if done is None else done

    def step(name: str) -> None:
        done.append(name)
        if fail == name:
            raise OSError(f"{name} failed")

    store_checkpoint(
        held, size, lambda: step("write"), lambda: step("record"), replaces=replaces, undo=lambda: step("undo")
    )
    return done


def test_a_checkpoint_within_the_limit_is_written_then_recorded_and_holds_nothing_after():
    held = reservation(stored=60, held=30)
    assert run(held, 40) == ["write", "record"]
    assert held.quotas._reserved == {} and held.held == 0


def test_over_the_limit_nothing_is_written_and_the_reservation_goes():
    held, done = reservation(stored=70, held=30), []
    with pytest.raises(ApiError) as refused:
        run(held, 40, done=done)
    assert refused.value.status == 403 and "checkpoint_bytes" in str(refused.value)
    assert done == [] and held.quotas._reserved == {} and held.held == 0


def test_an_overwrite_counts_only_what_it_adds():
    assert run(reservation(stored=90), 40, replaces=35) == ["write", "record"]


def test_a_failed_write_is_never_recorded_nor_undone():
    """A write is atomic: undoing a failed one could only delete a checkpoint already there
    under that name (another save's, which won the race to it)."""
    held, done = reservation(stored=0, held=10), []
    with pytest.raises(OSError):
        run(held, 10, fail="write", done=done)
    assert done == ["write"] and held.quotas._reserved == {} and held.held == 0


def test_a_checkpoint_whose_row_cannot_be_recorded_is_removed():
    held, done = reservation(stored=0, held=10), []
    with pytest.raises(OSError):
        run(held, 10, fail="record", done=done)
    assert done == ["write", "record", "undo"] and held.quotas._reserved == {} and held.held == 0


def test_without_a_reservation_it_is_written_and_recorded():
    assert run(None, 10**12) == ["write", "record"]
