"""The unit tests of what tests/e2e/test_fair_sampling.py tests end to end (no server here)."""

from __future__ import annotations

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.core.sampling import SampleSpec
from hosted_tinker.server.serving.sample_budget import SampleBudget

pytestmark = pytest.mark.fast


def test_the_budget_bounds_a_request_and_a_keys_requests_in_flight() -> None:
    budget = SampleBudget(100, {"k": 150}.get)
    budget.check(SampleSpec(prompt=[1], max_tokens=24, num_samples=4), "n * (prompt + max_tokens)")
    with pytest.raises(ApiError) as refused:
        budget.check(SampleSpec(prompt=[1], max_tokens=25, num_samples=4), "n * (prompt + max_tokens)")
    assert refused.value.status == 400 and "n * (prompt + max_tokens) must be at most 100" in refused.value.detail
    assert "got 4 * (1 + 25) = 104" in refused.value.detail
    # The prompt counts: 128 rows of a 4,000-token prompt with nothing to sample held the worker 20 s.
    with pytest.raises(ApiError, match="got 128 \\* \\(4000 \\+ 0\\) = 512000"):
        budget.check(SampleSpec(prompt=[1] * 4000, max_tokens=0, num_samples=128), "n * (prompt + max_tokens)")
    first = budget.reserve("k", SampleSpec(prompt=[1], max_tokens=99))
    second = budget.reserve("k", SampleSpec(prompt=[1], max_tokens=49))  # 150: at the limit, not past it
    with pytest.raises(ApiError) as refused:
        budget.reserve("k", SampleSpec(prompt=[1], max_tokens=1))
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    assert "limit sample_tokens reached: at most 150" in refused.value.detail
    first()
    first()  # once only
    assert budget.held == {"k": 50}
    second()
    assert budget.held == {}
    big = budget.reserve("k", SampleSpec(prompt=[1], max_tokens=200))  # over the limit, but the key holds none
    big()
    budget.reserve("open", SampleSpec(prompt=[1], max_tokens=10**6))  # no limit (an open server's key)
    budget.reserve(None, SampleSpec(prompt=[1], max_tokens=10**6))
