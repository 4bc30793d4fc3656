"""What sampling on the embedded engine may cost: ``n * (prompt + max_tokens)``, the positions a
request's rows hold (prefilled, then sampled: its KV cache, and the work of its forward passes),
bounded per request (``--max-sample-tokens``: a 400) and per key over its requests in flight
(the ``sample_tokens`` limit, ``server.quotas``: a 429 the SDK waits out). The engine shares the
training worker: this is the memory and worker time one request, and one key, can ask for at
once. The prompt counts: n=128 rows of a 4,000-token prompt with max_tokens=0 cost nothing as
``n * max_tokens`` and held the worker 20 s (4.3 GB of cache on the tiny model).
"""

from __future__ import annotations

from collections.abc import Callable

from hosted_tinker.core.errors import ApiError, bad_request, too_many
from hosted_tinker.core.sampling import SampleSpec

RETRY_AFTER_S = 1.0  # a key's requests in flight finish within seconds to minutes: ask again soon


def cost(spec: SampleSpec) -> int:
    """Positions a request's rows may hold: each prefills the prompt and decodes up to
    ``max_tokens``."""
    return spec.num_samples * (len(spec.prompt) + spec.max_tokens)


def over(held: int, cost: int, bound: int) -> bool:
    """Whether ``cost`` more would take ``held`` past ``bound``. A request always fits when its
    key holds none: it is within the per-request bound, and refused it would be retried forever."""
    return held > 0 and held + cost > bound


class SampleBudget:
    """The bounds, and each key's tokens in flight (on the event loop: taken and given back there,
    so that a check and its reservation are one step)."""

    def __init__(self, per_request: int, per_key: Callable[[str], int | None] = lambda _: None) -> None:
        self.per_request = per_request
        self.per_key = per_key  # a key's ``sample_tokens`` limit (None: no limit, as on an open server)
        self.held: dict[str, int] = {}

    def check(self, spec: SampleSpec, field: str) -> None:
        """400 for a request over the per-request bound; ``field`` is how its client spells the cost."""
        if cost(spec) > self.per_request:
            raise bad_request(
                f"{field} must be at most {self.per_request} (--max-sample-tokens: the positions one sampling "
                f"request's rows may hold on the worker), got {spec.num_samples} * ({len(spec.prompt)} + "
                f"{spec.max_tokens}) = {cost(spec)}"
            )

    def reserve(self, owner: str | None, spec: SampleSpec) -> Callable[[], None]:
        """Count ``spec`` against ``owner`` until the returned function is called (once); a 429
        naming the limit if it would pass it."""
        amount, bound = cost(spec), self.per_key(owner) if owner is not None else None
        if owner is None or bound is None:
            return lambda: None
        held = self.held.get(owner, 0)
        if over(held, amount, bound):
            raise _refused(bound, held, amount)
        self.held[owner] = held + amount
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self.held.pop(owner) - amount
            if left:
                self.held[owner] = left

        return release


def _refused(bound: int, held: int, amount: int) -> ApiError:
    error = too_many(
        f"limit sample_tokens reached: at most {bound} positions (n * (prompt + max_tokens)) of this key's "
        f"sampling requests in flight; {held} are, and this one's {amount} would pass it",
        RETRY_AFTER_S,
    )
    error.code = "quota_exceeded"
    return error
