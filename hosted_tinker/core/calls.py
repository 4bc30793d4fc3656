"""What a worker call is, declared where the call is defined (``@rank_call`` on the trainer's
and the sampler's methods), and read by the server that sends it (``server.workers.backend``).

ranks   "every": each rank runs it (it changes or gathers what they all hold; rank 0 answers);
        "first": rank 0 alone (it reads what rank 0 holds);
        "split": each data-parallel replica gets its shard of the batch (``core.sharding``);
        "split_many": the same for each ``(model_id, batch)`` of a list of several models' requests
model   what the call does to the training model named by its first argument: "uses" its state
        (the first such call after the model was rolled back to a checkpoint fails, once, to say
        so), or "replaces" it (which makes that rollback moot); None: neither
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

F = TypeVar("F", bound=Callable)


Ranks = Literal["every", "first", "split", "split_many"]
ModelEffect = Literal["uses", "replaces"] | None


@dataclass(frozen=True)
class CallSpec:
    ranks: Ranks
    model: ModelEffect = None


def rank_call(ranks: Ranks, model: ModelEffect = None):
    """Declare a method as a worker call (see the module docstring)."""

    def mark(fn: F) -> F:
        fn.__rank_call__ = CallSpec(ranks, model)
        return fn

    return mark


def call_spec(component: type, method: str) -> CallSpec:
    """The declaration of ``component.method``; ``TypeError`` if it is not a worker call."""
    spec = getattr(getattr(component, method, None), "__rank_call__", None)
    if spec is None:
        raise TypeError(f"{component.__name__}.{method} is not declared with @rank_call")
    return spec
