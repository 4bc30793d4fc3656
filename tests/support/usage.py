"""Reading usage totals and windows from the usage endpoints."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from tinker import types


def window() -> tuple[datetime, datetime]:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return hour - timedelta(hours=1), hour + timedelta(hours=2)


def totals(usage: types.BillingUsageResponse, session_id: str | None) -> dict[str, float]:
    """Each kind's quantity over the window's hours, for one session (None: no session)."""
    summed: dict[str, float] = defaultdict(float)
    for event in usage.data:
        if event.session_id == session_id:
            info = event.event_info
            summed[info.type] += (
                getattr(info, "token_count", None) or getattr(info, "count", None) or info.gigabyte_hours
            )
    return summed
