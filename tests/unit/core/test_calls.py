"""Worker calls as the server makes them (``core.calls``): each routed by its declaration, its
arguments shaped for the pipe, without a worker process (``tests/e2e/test_worker_unit.py`` has one)."""

from __future__ import annotations

import pytest

from hosted_tinker.core.calls import Call, CallSpec, call_spec, calls_to, on_rank_0, rank_call
from hosted_tinker.core.messages import Listener
from hosted_tinker.rank.sampler import EmbeddedSampler
from hosted_tinker.rank.trainer import Trainer

pytestmark = pytest.mark.fast


class Component:
    SERVED_AS = "thing"

    @rank_call("every", model="uses")
    def step(self, model_id: str, size: int, *, fast: bool = False) -> str:
        raise AssertionError("never run here: the proxy sends it")

    @rank_call("first", listeners=("on_token",))
    def run(self, key: str | None, admit=None, on_token=None, tail: int = 0) -> None:
        raise AssertionError("never run here")

    def helper(self) -> None:
        pass


def sent(call) -> list[Call]:
    calls: list[Call] = []
    proxy = calls_to(Component, lambda c: calls.append(c) or "answer")
    assert call(proxy) == "answer"
    return calls


def test_a_call_goes_by_its_declaration_as_it_was_made():
    (call,) = sent(lambda p: p.step("m", 3, fast=True))
    assert call == Call("thing.step", CallSpec("every", "uses"), ("m", 3), {"fast": True})
    assert call.model_id == "m"
    (call,) = sent(lambda p: p.step(model_id="m", size=3))  # by name: the same call
    assert (call.args, call.kwargs) == (("m", 3), {})


def test_callables_go_by_name_and_declared_listeners_are_wrapped():
    def admit():
        return []

    def hear(*_):
        return None

    (call,) = sent(lambda p: p.run(None, admit, hear, 2))
    assert call.args == (None,) and call.model_id is None  # no model: its first argument is not one
    assert call.kwargs == {"admit": admit, "on_token": Listener(hear), "tail": 2}
    (call,) = sent(lambda p: p.run("k", on_token=None))
    assert call.kwargs == {"on_token": None}  # nothing to listen with: sent as it is


def test_what_is_not_a_worker_call_is_refused():
    proxy = calls_to(Component, lambda c: None)
    with pytest.raises(TypeError, match="Component.helper is not declared"):
        proxy.helper()
    with pytest.raises(TypeError, match="missing a required argument: 'size'"):
        proxy.step("m")  # a call that does not fit the signature never leaves
    with pytest.raises(TypeError):
        proxy.missing()
    assert not hasattr(proxy, "__deepcopy__")  # asked of any object by copy and pickle: no call


def test_every_call_of_the_ranks_is_declared_once_on_its_method():
    """The server's calls are exactly these (what the other modules make through calls_to)."""
    declared = {
        cls.SERVED_AS: sorted(n for n in dir(cls) if getattr(getattr(cls, n), "__rank_call__", None) is not None)
        for cls in (Trainer, EmbeddedSampler)
    }
    assert declared == {
        "trainer": [
            "create_adapter",
            "delete_adapter",
            "export_state",
            "forward_backward",
            "forward_backward_many",
            "has_adapter",
            "load_state",
            "optim_step",
            "peft_config",
            "snapshot_weights",
            "zero_adapter",
        ],
        "sampler": ["decode_slice", "generate", "has_sampler", "load_sampler"],
    }
    assert call_spec(Trainer, "create_adapter").model == "creates"
    assert call_spec(Trainer, "delete_adapter").model == "deletes"


def test_rank_0_answers_a_gathering_call():
    assert on_rank_0(5) == 5
    with pytest.raises(RuntimeError, match="rank 0 answered None"):
        on_rank_0(None)
