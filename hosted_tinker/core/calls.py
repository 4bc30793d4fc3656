"""What a worker call is, declared once where the call is defined (``@rank_call`` on the
trainer's and the sampler's methods), and how the server makes it (``calls_to``).

ranks     "every": each rank runs it (it changes or gathers what they all hold; rank 0 answers);
          "first": rank 0 alone (it reads what rank 0 holds);
          "split": each data-parallel replica gets its shard of the batch (``core.sharding``);
          "split_many": the same for each ``(model_id, batch)`` of a list of several models' requests
model     what the call does to the training model named by its first argument: "creates" it
          (the server counts it among the models its workers hold, to restore them after a
          worker death), "uses" its state (the first such call after the model was rolled back
          to a checkpoint fails, once, to say so), "replaces" it (which makes that rollback
          moot), or "deletes" it (as "replaces", and the server stops counting it); None: neither
listeners the callable parameters whose return value nobody needs (``on_token``): the worker
          notifies them and goes on; any other callable argument is called back and answered

The server holds a rank class's calls as ``calls_to(Trainer, send)``: typed as the class itself,
so each call site is checked against the method's real signature, and every attribute read on
it is a call routed by its declaration (a method that is not declared is a ``TypeError``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from hosted_tinker.core.messages import Listener

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

Ranks = Literal["every", "first", "split", "split_many"]
ModelEffect = Literal["creates", "uses", "replaces", "deletes"] | None


@dataclass(frozen=True)
class CallSpec:
    ranks: Ranks
    model: ModelEffect = None
    listeners: tuple[str, ...] = ()


def rank_call(ranks: Ranks, model: ModelEffect = None, listeners: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare a method as a worker call (see the module docstring)."""

    def mark(fn: F) -> F:
        fn.__rank_call__ = CallSpec(ranks, model, listeners)  # type: ignore[attr-defined]  # a mark on the function
        return fn

    return mark


def call_spec(component: type, method: str) -> CallSpec:
    """The declaration of ``component.method``; ``TypeError`` if it is not a worker call."""
    spec = getattr(getattr(component, method, None), "__rank_call__", None)
    if spec is None:
        raise TypeError(f"{component.__name__}.{method} is not declared with @rank_call")
    return cast(CallSpec, spec)


@dataclass(frozen=True)
class Call:
    """One call as it goes to the worker: ``method`` is ``"trainer.optim_step"`` (the component
    as the worker serves it, ``SERVED_AS``). Arguments go by position up to the first one that
    is callable, left out or keyword-only, by name from there: a callable crosses the process
    only as a keyword argument (``WorkerProcess.call``), a declared listener wrapped as one."""

    method: str
    spec: CallSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str | None:
        """The training model it names (its first argument), if its declaration says it has one."""
        return self.args[0] if self.spec.model is not None else None


class _Calls:
    """The stand-in ``calls_to`` returns; see there."""

    def __init__(self, component: type, send: Callable[[Call], Any]) -> None:
        self._component = component
        self._send = send

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("__"):  # what hasattr, copy and pickle ask of any object: not a call
            raise AttributeError(method)
        component = self._component
        spec = call_spec(component, method)
        signature = inspect.signature(getattr(component, method))
        served_as = f"{component.SERVED_AS}.{method}"  # type: ignore[attr-defined]  # every rank class has one

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._send(_shaped(served_as, spec, signature.bind(None, *args, **kwargs)))

        call.__name__ = method
        return call


def _shaped(method: str, spec: CallSpec, bound: inspect.BoundArguments) -> Call:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    by_name = False
    for name, parameter in list(bound.signature.parameters.items())[1:]:  # [0]: self
        if name not in bound.arguments:
            by_name = True
            continue
        value = bound.arguments[name]
        if callable(value) or parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            by_name = True
        if name in spec.listeners and value is not None:
            value = Listener(value)
        if by_name:
            kwargs[name] = value
        else:
            args.append(value)
    return Call(method, spec, tuple(args), kwargs)


def calls_to(component: type[T], send: Callable[[Call], Any]) -> T:
    """``component``'s worker calls, each sent by ``send`` (which routes it by its ``spec``) and
    answered with what ``send`` returns. Typed as ``component``: a call site is checked against
    the real signature, and the answer has the method's return type (for a call the ranks
    answer with a gather onto rank 0, ``on_rank_0`` drops the other ranks' ``None``)."""
    return cast(T, _Calls(component, send))


def on_rank_0(answer: T | None) -> T:
    """The answer of an "every" call that gathers onto rank 0, whose other ranks answer None:
    the server gets rank 0's, which is never None."""
    if answer is None:
        raise RuntimeError("rank 0 answered None to a call that gathers onto it")
    return answer
