"""``core.custom_loss``: graphs the real SDK traces and encodes (``trace_loss``, ``encode_graph``)
run by our interpreter exactly as the SDK's own ``torch.fx`` module runs them (values and
gradients), and every kind of node it must refuse refused, at creation or when run."""

from __future__ import annotations

import time

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from torch.overrides import TorchFunctionMode

from hosted_tinker.core.custom_loss import CustomLossDef, CustomLossError, compile_loss, reduce_metrics

pytestmark = pytest.mark.fast


def ppo_like(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": (logprobs * 0 + 1).sum()}


def topk_distill(logprobs, target_distribution, beta):
    head = logprobs[..., 0:2].float().to(torch.float32)
    smooth = torch.nn.functional.softplus(head).pow(2).mean(dim=-1).sum()
    return -(target_distribution * logprobs).sum() + beta * smooth, {}


def shaped(logprobs, weights):
    n = logprobs.shape[0]
    scale = 1.0 / (n + 1)
    masked = torch.where(weights > 0, logprobs, torch.zeros_like(logprobs))
    return -(masked.sum() * scale) + logprobs.logsumexp(dim=0) * 0.0, {"custom/len:sum": logprobs.sum() * 0 + n}


def _ours(fn, ranks):
    handle = trace_loss(fn, ranks, "sess")
    nodes = [node.model_dump() for node in encode_graph(handle).nodes]
    loss = CustomLossDef(handle.name, tuple((i.name, i.rank) for i in handle.inputs), tuple(nodes)).compile()
    return handle, loss


@pytest.mark.parametrize(
    "fn, ranks, shapes",
    [
        (ppo_like, {"logprobs": 1, "advantages": 1, "old": 1}, {"advantages": (7,), "old": (7,)}),
        (
            topk_distill,
            {"logprobs": 2, "target_distribution": 2, "beta": 0},
            {"target_distribution": (7, 3), "beta": ()},
        ),
        (shaped, {"logprobs": 1, "weights": 1}, {"weights": (7,)}),
    ],
)
def test_runs_as_the_sdk_traced_graph_does(fn, ranks, shapes):
    handle, loss = _ours(fn, ranks)
    gen = torch.Generator().manual_seed(0)
    lp_shape = (7,) if ranks["logprobs"] == 1 else (7, 3)
    lp = -torch.rand(lp_shape, generator=gen, dtype=torch.float64)
    inputs = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    mine, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    got_loss, got_metrics = loss(mine, inputs)
    want_loss, want_metrics = handle.graph(theirs, *(inputs[n] for n in handle.input_names))
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got_metrics.keys() == want_metrics.keys()
    for key in got_metrics:
        torch.testing.assert_close(got_metrics[key], want_metrics[key], rtol=0, atol=0)
    got_loss.backward(), want_loss.backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_metrics_reduce_as_the_sdk_does():
    """The server sums a custom loss's metrics over the datums and reduces them once; the SDK's own
    reducer (``_metrics_reduction``, which folds chunked results, weighting each by its datums)
    over one result per datum gives the same: sums add up, means are the datums' mean."""
    from tinker import types
    from tinker.lib.chunked_fwdbwd_helpers import _metrics_reduction

    per_datum = [
        {"custom/a:sum": 1.5, "custom/b:mean": 0.25},
        {"custom/a:sum": 4.0, "custom/b:mean": 3.0},
        {"custom/a:sum": -2.0, "custom/b:mean": 1.0},
    ]
    sdk = _metrics_reduction(
        [
            types.ForwardBackwardOutput(loss_fn_output_type="TorchLossReturn", loss_fn_outputs=[{}], metrics=m)
            for m in per_datum
        ]
    )
    sums = {key: sum(m[key] for m in per_datum) for key in per_datum[0]}
    assert reduce_metrics(sums, len(per_datum)) == pytest.approx(sdk)
    assert sdk == pytest.approx({"custom/a:sum": 3.5, "custom/b:mean": 4.25 / 3})


def _graph(*middle: dict, output: object = None) -> list[dict]:
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}, *middle]
    out = output if output is not None else {"tuple": [{"ref": nodes[-1]["name"]}, {"dict": {}}]}
    return [*nodes, {"op": "output", "name": "output", "target": "output", "args": [out]}]


def _call(name: str, target: str, *args, op: str = "call_function", **kwargs) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "nodes, needle",
    [
        (_graph(_call("x", "os.system", "true")), "calling 'os.system' is not allowed"),
        (_graph(_call("x", "builtins.eval", "1")), "calling 'builtins.eval' is not allowed"),
        (_graph(_call("x", "torch.zeros", 10**9)), "calling 'torch.zeros' is not allowed"),
        (_graph(_call("x", "torch.load", "f")), "calling 'torch.load' is not allowed"),
        (_graph(_call("x", "backward", LP, op="call_method")), "method 'backward' is not allowed"),
        (_graph(_call("x", "item", LP, op="call_method")), "method 'item' is not allowed"),
        (_graph(_call("x", "__reduce__", LP, op="call_method")), "method '__reduce__' is not allowed"),
        (_graph({"op": "get_attr", "name": "w", "target": "weight"}), "'get_attr' nodes are not allowed"),
        (_graph({"op": "call_module", "name": "m", "target": "linear"}), "'call_module' nodes are not allowed"),
        (_graph(_call("x", "torch.exp", {"ref": "later"})), "refers to 'later', which is not an earlier node"),
        (_graph(_call("x", "torch.exp", {"code": "import os"})), "cannot decode"),
        ([{"op": "placeholder", "name": "other", "target": "other"}], "placeholders"),
        (_graph(*[_call(f"n{i}", "torch.exp", LP) for i in range(600)]), "over the limit of 512"),
        (_graph(_call("x", "torch.exp", _nested(500))), "nested over 8 deep"),  # was a RecursionError
        (_graph(_call("x", "torch.cat", [LP] * 2048)), "a list of 2048 arguments, over 64"),
    ],
)
def test_nodes_outside_the_allowed_operations_are_refused_at_creation(nodes, needle):
    with pytest.raises(CustomLossError, match=needle):
        compile_loss("evil", [("logprobs", 1)], nodes)


@pytest.mark.parametrize(
    "middle, needle",
    [
        ((_call("x", "getattr", LP, "__class__"),), "only these tensor attributes"),
        ((_call("s", "getattr", LP, "shape"), _call("x", "sum", {"ref": "s"}, op="call_method")), "not a tensor"),
        ((_call("x", "operator.mul", [0], 10**9),), "tensors and numbers only"),
        ((_call("x", "operator.pow", 10, 10**6),), "too large"),
        ((_call("x", "to", LP, "meta", op="call_method"),), "not a string"),
        (
            (
                _call("a", "unsqueeze", LP, 0, op="call_method"),
                _call("b", "unsqueeze", LP, 1, op="call_method"),
                _call("x", "operator.mul", {"ref": "a"}, {"ref": "b"}),
                _call("y", "unsqueeze", {"ref": "x"}, 0, op="call_method"),
                _call("w", "unsqueeze", {"ref": "x"}, 2, op="call_method"),
                _call("z", "operator.mul", {"ref": "y"}, {"ref": "w"}),
            ),
            "over this datum's bound",
        ),
        ((_call("x", "torch.exp", LP),), "must return a scalar loss"),
    ],
)
def test_runs_that_break_the_rules_fail_as_user_errors(middle, needle):
    loss = compile_loss("evil", [("logprobs", 1)], _graph(*middle))
    with pytest.raises(CustomLossError, match=needle) as info:
        loss(torch.zeros(200), {})
    assert info.value.category == "user"


def _outer(a: dict, b: dict, name: str) -> tuple[dict, ...]:
    """Nodes that make the outer product of two vectors: ``name`` holds len(a) * len(b)."""
    return (
        _call(f"{name}_a", "unsqueeze", a, 0, op="call_method"),
        _call(f"{name}_b", "unsqueeze", b, 1, op="call_method"),
        _call(name, "operator.mul", {"ref": f"{name}_a"}, {"ref": f"{name}_b"}),
    )


class Calls(TorchFunctionMode):
    """The device of each call of one ``torch.Tensor`` method, while active. Not a patch of the
    method: CPython keeps a Python-level ``__getitem__`` in the type's sequence slot after it is
    put back, and ``torch.tensor()`` of a list of 0-d tensors then fails for the whole process."""

    def __init__(self, method) -> None:
        super().__init__()
        self.method, self.devices = method, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is self.method:
            self.devices.append(args[0].device.type)
        return func(*args, **(kwargs or {}))


def test_a_value_over_its_bound_is_refused_before_it_is_allocated():
    """An outer product of 64 copies of an 8-token datum's logprobs (512 x 512 = 262,144, over
    nothing) is fine; of 64 x 64 copies of them it would hold 268M elements: refused from its
    shape on the meta device, before any memory is taken."""
    wide = (_call("w", "torch.cat", [LP] * 64), _call("ww", "torch.cat", [{"ref": "w"}] * 64))
    loss = compile_loss("evil", [("logprobs", 1)], _graph(*wide, *_outer({"ref": "ww"}, {"ref": "ww"}, "x")))
    with Calls(torch.Tensor.__mul__) as made, pytest.raises(CustomLossError, match="over this datum's bound"):
        loss(torch.zeros(8), {})
    assert "cpu" not in made.devices  # the product ran on meta tensors only


def test_the_values_of_a_pass_are_bounded_in_all():
    """512 nodes each as large as a datum may make one are over what a pass's losses may hold in
    all (as if each node held its datum's inputs): refused at the node that passes it."""
    big = (_call("w", "torch.cat", [LP] * 64), *_outer({"ref": "w"}, {"ref": "w"}, "x"))  # 262,144 each
    copies = tuple(_call(f"c{i}", "torch.exp", {"ref": f"c{i - 1}" if i else "x"}) for i in range(500))
    loss = compile_loss("heavy", [("logprobs", 1)], _graph(*big, *copies))
    with pytest.raises(CustomLossError, match="over their bound of 8388608 bytes in all"):
        loss(torch.zeros(8), {})


def test_a_loss_returns_at_most_64_metrics():
    """Each metric is stored with every step: a loss cannot return thousands (a dict of more is
    refused when the loss is made; one built up at run time, when it runs)."""
    total = _call("t", "sum", LP, op="call_method")
    metrics = {f"custom/m{i}:sum": {"ref": "t"} for i in range(65)}
    with pytest.raises(CustomLossError, match="65 arguments, over 64"):
        compile_loss("chatty", [("logprobs", 1)], _graph(total, output={"tuple": [{"ref": "t"}, {"dict": metrics}]}))
    from hosted_tinker.core.custom_loss import _check_result

    with pytest.raises(CustomLossError, match="65 metrics, over 64"):
        _check_result("chatty", (torch.zeros(()), {f"custom/m{i}:sum": torch.zeros(()) for i in range(65)}))


# ---- one datum's loss cannot reach another's memory (an attacker's audit) ---------------------


def test_no_allowed_operation_writes_into_a_value():
    """In-place methods (``add_``, ``set_``, ``resize_``) are not on the lists, and ``out=``, which
    resizes and fills the tensor it is given, is refused when the loss is made."""
    from hosted_tinker.core.custom_loss import FUNCTIONS, METHODS

    assert not [m for m in METHODS if m.endswith("_")]
    assert not [n for n in FUNCTIONS if n.rsplit(".", 1)[-1].endswith("_") and not n.startswith("operator.")]
    nodes = _graph(
        _call("c", "torch.exp", LP),
        _call("view", "detach", LP, op="call_method"),
        _call("w", "torch.mul", {"ref": "c"}, 1.0, out={"ref": "view"}),
        _call("s", "sum", {"ref": "w"}, op="call_method"),
    )
    with pytest.raises(CustomLossError, match=r"nodes\[3\] \(w\): out= is not allowed"):
        compile_loss("evil", [("logprobs", 1)], nodes)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_graph_gets_fresh_copies_of_its_datum_however_the_batch_is_packed():
    """The audit's attack: ``torch.mul(c, 1.0, out=<a detached view of logprobs>)`` resized the
    view of the packed log-probs and overwrote the next datum's. Even a writing node that got
    past the checks (built here by hand) writes only into the graph's own copy: the packed
    tensor, its gradient and the next datum's values are untouched."""
    from hosted_tinker.core.custom_loss import CustomLoss, CustomLossInput, _Node, _Ref

    packed = torch.arange(12, dtype=torch.float32).requires_grad_()
    before = packed.detach().clone()
    mine, victims = packed[:4], packed[4:]
    nodes = (
        _Node("placeholder", "logprobs", "logprobs", (), {}),
        _Node("placeholder", "weights", "weights", (), {}),
        _Node("call_method", "view", "detach", (_Ref("logprobs"),), {}),
        _Node("call_method", "wview", "detach", (_Ref("weights"),), {}),
        _Node("call_function", "c", torch.full_like, (_Ref("logprobs"), 5.0), {}),
        _Node("call_function", "big", torch.cat, ([_Ref("c"), _Ref("c"), _Ref("c")],), {}),
        _Node("call_function", "w", torch.mul, (_Ref("big"), 1.0), {"out": _Ref("view")}),
        _Node("call_function", "w2", torch.mul, (_Ref("big"), 1.0), {"out": _Ref("wview")}),
        _Node("call_method", "s", "sum", (_Ref("logprobs"),), {}),
        _Node("output", "output", "output", ((_Ref("s"), {}),), {}),
    )
    loss = CustomLoss("evil", (CustomLossInput("logprobs", 1), CustomLossInput("weights", 1)), nodes)
    weights_packed = torch.ones(12)
    value, _ = loss(mine, {"weights": weights_packed[:4]})
    value.backward()
    assert torch.equal(packed.detach(), before) and torch.equal(victims.detach(), before[4:])
    assert torch.equal(weights_packed, torch.ones(12))
    assert torch.equal(packed.grad, torch.tensor([1.0] * 4 + [0.0] * 8))


def _masked_copies(times: int) -> tuple[dict, ...]:
    """A long double value, then ``times`` boolean-mask selections of it (their size depends on
    the data: the meta device alone cannot say it)."""
    return (
        _call("wide", "torch.cat", [LP] * 64),
        _call("dbl", "double", {"ref": "wide"}, op="call_method"),
        _call("mask", "operator.gt", {"ref": "dbl"}, float("-inf")),
        *(_call(f"sel{i}", "operator.getitem", {"ref": "dbl"}, {"ref": "mask"}) for i in range(times)),
        _call("total", "torch.stack", [{"ref": f"sel{i}"} for i in range(times)]),
        _call("sum", "sum", {"ref": "total"}, op="call_method"),
    )


def test_a_boolean_mask_is_charged_at_its_largest_before_it_runs():
    """The audit's OOM: boolean-mask indexing could not be sized in advance, so it was not
    charged (ten selections of a 64M-element double tensor killed the worker). A selection is
    now sized as if every element were selected, before it runs: one works and gives the right
    value; of ten selections of a 4,096-token datum's 2 MiB value, the one that would pass its
    8 MiB is refused before it runs on real data."""
    lp = -torch.rand(4096)
    one = compile_loss("one", [("logprobs", 1)], _graph(*_masked_copies(1)))
    value, _ = one(lp, {})
    assert value.item() == pytest.approx(64 * lp.double().sum().item())

    ten = compile_loss("ten", [("logprobs", 1)], _graph(*_masked_copies(10)))
    with Calls(torch.Tensor.__getitem__) as ran:
        with pytest.raises(CustomLossError, match="failed at node 'sel2'.*over their bound of 8388608 bytes"):
            ten(lp, {})
    assert (
        ran.devices.count("cpu") == 2
    )  # 1 + 2 + 0.25 + 2 + 2 MiB: sel0 and sel1 ran; sel2 was refused from its meta size


def test_a_joint_pass_shares_one_bound():
    """Each request's losses have their own allowance, and all those of one pass (a joint
    pass's requests) are also held to the pass's: several requests cannot add up past it."""
    from hosted_tinker.core.custom_loss import MAX_PASS_BYTES, allowance_for, pass_allowance

    shared = pass_allowance()
    big = [[torch.zeros(1 << 20)]]  # 4 MiB of inputs: each request may hold 1 GiB alone
    first, second = allowance_for(big, within=shared), allowance_for(big, within=shared)
    first.take(MAX_PASS_BYTES // 2 + 1)
    with pytest.raises(CustomLossError, match="over their bound"):
        second.take(MAX_PASS_BYTES // 2)


# ---- from a review as an attacker: work and memory a node makes without returning it -----------


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_what_operands_broadcast_to_is_bounded_even_when_the_node_reduces_it():
    """``mse_loss`` of a column and a row makes the whole square before it reduces it to one
    number (40,000 elements: 6.4 GB, charged 4 bytes); the broadcast is sized first."""
    import torch.nn.functional as F

    def bomb(logprobs, x):
        return F.mse_loss(x.unsqueeze(1), x.unsqueeze(0)) + logprobs.sum(), {}

    _, loss = _ours(bomb, {"logprobs": 1, "x": 1})
    with pytest.raises(CustomLossError, match="its operands broadcast to 1600000000 elements, over"):
        loss(torch.zeros(40_000), {"x": torch.zeros(40_000)})


def test_work_is_bounded_as_well_as_memory():
    """500 log-sum-exps over the largest value a datum may make hold almost nothing but took 20 s
    of a CPU; the elements a datum's nodes work through are bounded (1,024 per input element):
    here the 14th of 250 is refused."""
    wide = _call("w", "torch.cat", [LP] * 64)
    reductions = [_call(f"r{i}", "torch.logsumexp", {"ref": "w"}, 0) for i in range(250)]
    sums = [_call(f"a{i}", "operator.add", {"ref": f"a{i - 1}" if i else "r0"}, {"ref": f"r{i}"}) for i in range(250)]
    loss = compile_loss("slow", [("logprobs", 1)], _graph(wide, *reductions, *sums))
    started = time.perf_counter()
    with pytest.raises(CustomLossError, match="node .r13.: the loss works through over its bound of 67108864 elements"):
        loss(torch.zeros(65_536), {})
    assert time.perf_counter() - started < 5


def test_nodes_the_output_does_not_use_are_not_run(monkeypatch: pytest.MonkeyPatch):
    ran: list[str] = []
    real_exp = torch.exp
    monkeypatch.setitem(
        __import__("hosted_tinker.core.custom_loss", fromlist=["FUNCTIONS"]).FUNCTIONS,
        "torch.exp",
        lambda *a, **k: ran.append("exp") or real_exp(*a, **k),
    )
    nodes = _graph(_call("unused", "torch.exp", LP), _call("s", "sum", LP, op="call_method"))
    loss = compile_loss("lean", [("logprobs", 1)], nodes)
    assert [n.name for n in loss.nodes] == ["logprobs", "s", "output"]
    assert loss(torch.ones(3), {})[0].item() == 3.0 and ran == []


@pytest.mark.parametrize(
    "node",
    [
        _call("r", "torch.nn.functional.relu", LP, inplace=True),
        _call("r", "torch.nn.functional.relu", LP, True),
        _call("r", "torch.nn.functional.silu", LP, True),
    ],
)
def test_inplace_is_refused_by_name_and_by_position(node: dict):
    with pytest.raises(CustomLossError, match=r"\(r\): inplace= is not allowed"):
        compile_loss("evil", [("logprobs", 1)], _graph(node, _call("s", "sum", {"ref": "r"}, op="call_method")))


def test_the_fields_of_a_reductions_named_tuple_may_be_read():
    def top(logprobs):
        best = logprobs.max(dim=-1)
        return -best.values.sum() + best.indices.sum() * 0, {}

    _, loss = _ours(top, {"logprobs": 2})
    lp = torch.tensor([[1.0, 3.0], [5.0, 2.0]])
    assert loss(lp, {})[0].item() == -8.0
