"""Server-side custom losses: the SDK's traced ``torch.fx`` graph, rebuilt from plain data and
run by a small interpreter over an explicit list of allowed operations. Nothing is ``eval``ed
or imported by name: a node's target is looked up in ``FUNCTIONS``, ``METHODS`` or
``ATTRIBUTES``, and anything else is refused when the loss is created.

A loss runs once per datum on ``(logprobs, *inputs)`` (each a tensor; ``logprobs`` shaped like
the datum's ``target_tokens``) and returns ``(loss, metrics)``: a scalar tensor, and scalar
tensors keyed ``custom/<name>:sum`` or ``custom/<name>:mean``. The batch's loss is the sum of
the datums' (as for the built-in losses); ``:sum`` metrics add over datums, ``:mean`` ones are
averaged over them (as the SDK's client-side runner does).

A loss runs alone with its own datum, whatever else shares the pass (another tenant's datums,
in a joint pass): its inputs are handed over as fresh tensors (copies, ``logprobs`` still in
autograd), so nothing a graph does can reach another datum's memory, and no node may write into
a value (no ``out=``, no ``inplace``, no in-place method). Every node's result is sized on the
meta device before it runs (a data-dependent shape, as a boolean mask's, at its largest: every
element selected), as is what its operands broadcast to (``mse_loss`` of a column and a row
makes the whole square before it reduces it), and charged against the datum's and the pass's
bounds, in bytes held and in elements worked through; a node that cannot be sized is refused.
A graph has at most ``MAX_NODES`` nodes; those its output does not use are not run, and a value
is let go after its last use.
"""

from __future__ import annotations

import builtins
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor
from torch.fx.node import _get_qualified_name  # the SDK names targets with it
from torch.nn import functional as F

from hosted_tinker.core.errors import UserError

MAX_NODES = 512
MAX_INPUTS = 16
MAX_DEPTH = 8  # arguments nested in lists, tuples and dicts
MAX_ARGS = 64  # items of one argument list (torch.cat's tensors, a shape)
MAX_METRICS = 64  # each is stored with every step's metrics
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

# Functions a node may call, by the qualified name the SDK sends.
_TORCH = """abs exp expm1 exp2 log log1p log2 sqrt rsqrt square sigmoid tanh sign relu neg reciprocal pow
    clamp clip minimum maximum min max where sum mean prod logsumexp softmax log_softmax amax amin cumsum
    stack cat zeros_like ones_like full_like isfinite isnan nan_to_num logical_and logical_or logical_not
    gather squeeze unsqueeze flatten numel detach lerp erf atan sin cos floor ceil round trunc fmod
    remainder lt le gt ge eq ne add sub mul div true_divide"""
_FUNCTIONAL = "relu softplus logsigmoid log_softmax softmax silu gelu mse_loss"
_OPERATOR = "add sub mul truediv floordiv mod pow neg pos abs getitem lt le gt ge eq ne and_ or_ xor invert not_"
_MATH = "exp log sqrt log1p expm1 tanh fabs"


def _wire_name(fn: Callable[..., Any]) -> str:
    """A function's name as the SDK sends it: torch.fx's qualified name (``torch._C._nn.softplus``
    for some ``torch.nn.functional`` builtins), Python operators under ``operator``."""
    name = _get_qualified_name(fn)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


FUNCTIONS: dict[str, Callable[..., Any]] = {
    _wire_name(fn): fn
    for fn in (
        *(getattr(torch, n) for n in _TORCH.split()),
        *(getattr(F, n) for n in _FUNCTIONAL.split()),
        *(getattr(operator, n) for n in _OPERATOR.split()),
        *(getattr(math, n) for n in _MATH.split()),
        builtins.getattr,  # of the tensor attributes in ``ATTRIBUTES`` only
    )
}
# Tensor methods a node may call (``call_method``), and attributes ``getattr`` may read.
METHODS = frozenset(
    """abs exp expm1 log log1p log2 sqrt rsqrt square sigmoid tanh sign relu neg reciprocal pow clamp clip
    clamp_min clamp_max minimum maximum min max sum mean prod logsumexp softmax log_softmax amax amin cumsum
    where masked_fill gather squeeze unsqueeze flatten view reshape view_as reshape_as size numel dim
    detach float double to type_as t transpose isfinite isnan nan_to_num lt le gt ge eq ne add sub mul div
    logical_and logical_or logical_not floor ceil round""".split()
)
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
_DTYPES = {n: getattr(torch, n) for n in "float32 float64 float16 bfloat16 int64 int32 bool".split()}
# Keyword arguments that would make a node write into a value it was given (``out=`` resizes
# and fills its tensor: a view of shared memory would be written past its end).
WRITING_KWARGS = frozenset({"out", "inplace"})
# Functions whose second positional argument is ``inplace``.
_INPLACE_SECOND = frozenset({F.relu, F.silu})
# Fields of the named tuples some reductions return (``x.max(dim=0).values``).
RETURN_FIELDS = frozenset({"values", "indices"})
# Functions whose result is a Python number, never a tensor: nothing to size.
_NUMBER_RESULTS = frozenset(getattr(math, n) for n in _MATH.split())


class CustomLossError(UserError):
    """A graph that cannot be run, or a run that failed: the client's to fix."""


@dataclass(frozen=True)
class CustomLossDef:
    """A loss as stored and sent to the ranks: plain data, checked again where it is compiled."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), ``logprobs`` first
    nodes: tuple[dict, ...]  # ``CustomLossGraph.nodes`` as the SDK sent them

    def compile(self) -> CustomLoss:
        return compile_loss(self.name, list(self.inputs), list(self.nodes))


@dataclass(frozen=True)
class CustomLossInput:
    name: str
    rank: int  # 0: a scalar, 1: (N,), 2: (N, K)


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    target: Any  # the callable, method name or output
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class CustomLoss:
    """A checked graph, ready to run (``__call__``)."""

    name: str
    inputs: tuple[CustomLossInput, ...]  # ``logprobs`` first
    nodes: tuple[_Node, ...]  # the ones the output uses, in order
    last_use: tuple[tuple[str, ...], ...] = ()  # by node: the values no later node reads

    def __call__(
        self, logprobs: Tensor, inputs: Mapping[str, Tensor], allowance: Allowance | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``allowance``: what the values of every datum of one backward pass may hold in all
        (they all stay in autograd until it); by default this datum's own (``allowance_for``).
        ``logprobs`` and ``inputs`` may be views of a batch's tensors: the graph gets copies."""
        # Fresh memory: a graph sees only its datum, however its caller packed the batch.
        values = [logprobs.clone(), *(inputs[i.name].clone() for i in self.inputs[1:])]
        budget = max(MIN_ELEMENTS, ELEMENTS_PER_INPUT * max(v.numel() for v in values))
        allowance = allowance if allowance is not None else allowance_for([values])
        env: dict[str, Any] = dict(zip((i.name for i in self.inputs), values, strict=True))
        for node, done in zip(self.nodes, self.last_use or [()] * len(self.nodes), strict=True):
            try:
                if node.op == "placeholder":
                    continue
                a, kw = _resolve(node.args, env), _resolve(node.kwargs, env)
                if node.op != "output":
                    _check_size(node, a, kw, budget, allowance)  # before anything is allocated
                    env[node.name] = _bounded(_apply(node, a, kw), budget)
                    for name in done:  # autograd keeps what the backward pass needs
                        del env[name]
                    continue
            except Exception as e:  # shapes, dtypes, arguments, bounds: the loss's own mistake
                raise CustomLossError(f"custom loss {self.name!r} failed at node {node.name!r}: {e}") from None
            return _check_result(self.name, a[0])
        raise CustomLossError(f"custom loss {self.name!r} has no output node")


# What one datum's loss may hold: no value over this many elements (nor a Python integer over
# 64 bits), so that a small graph cannot grow a value by repeated doubling or outer products.
ELEMENTS_PER_INPUT = 64
MIN_ELEMENTS = 1 << 20
# What the values of one backward pass's custom losses may hold in all: as if each of a largest
# graph's nodes held its datums' inputs (at least MIN_PASS_BYTES), and never more than
# MAX_PASS_BYTES, whatever the batch: the worker is shared by every tenant.
MIN_PASS_BYTES = 8 << 20
MAX_PASS_BYTES = 1 << 30
# The elements a datum's nodes may read and write in all (a node's operands, what they broadcast
# to, and its results): this many per element of its inputs (at least MIN_WORK), and those of one
# pass at most MAX_PASS_WORK, so that a graph cheap in memory cannot hold the shared worker for
# long (500 log-sum-exps over the largest value a datum may make took 20 s of a CPU). A loss
# reads its inputs some tens of times.
WORK_PER_ELEMENT = 1024
MIN_WORK = 1 << 24
MAX_PASS_WORK = 1 << 30
_NUMBERS = (Tensor, int, float, bool)
_ARITHMETIC = {getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")}


def _apply(node: _Node, a: list, kw: dict) -> Any:
    if node.op == "call_method":
        if not isinstance(a[0], Tensor):
            raise CustomLossError(f"method {node.target!r} is called on a {type(a[0]).__name__}, not a tensor")
        if node.target == "to" and any(isinstance(x, str) for x in (*a[1:], *kw.values())):
            raise CustomLossError("to() takes a dtype or a device object here, not a string")
        return getattr(a[0], node.target)(*a[1:], **kw)
    fn = node.target
    if fn is builtins.getattr and not (len(a) == 2 and _readable(a[0], a[1])):
        raise CustomLossError(
            f"only these tensor attributes may be read: {sorted(ATTRIBUTES)}, and {sorted(RETURN_FIELDS)} "
            "of what max, min and the like return"
        )
    if fn in _ARITHMETIC:
        if not all(isinstance(x, _NUMBERS) for x in a):
            raise CustomLossError("arithmetic is on tensors and numbers only")
        if fn is operator.pow and not isinstance(a[0], Tensor) and isinstance(a[1], int) and abs(a[1]) > 64:
            raise CustomLossError(f"an integer power of {a[1]} is too large")
    return fn(*a, **kw)


def _readable(value: Any, attribute: Any) -> bool:
    if isinstance(value, Tensor):
        return attribute in ATTRIBUTES
    return type(value).__module__ == "torch.return_types" and attribute in RETURN_FIELDS


class Allowance:
    """What the custom losses of one backward pass may still take: bytes of values (each datum's
    graph stays in autograd until the pass's backward) and elements worked through; what is
    taken is also taken from ``within``, the bound of every request that shares the pass."""

    def __init__(self, bytes_: int, work: int, within: Allowance | None = None) -> None:
        self.bound, self.work_bound = bytes_, work
        self.left, self.work_left = bytes_, work
        self.within = within

    def take(self, bytes_: int, work: int = 0) -> None:
        if bytes_ > self.left:
            raise CustomLossError(f"the loss's values are over their bound of {self.bound} bytes in all")
        if work > self.work_left:
            raise CustomLossError(f"the loss works through over its bound of {self.work_bound} elements in all")
        if self.within is not None:
            self.within.take(bytes_, work)
        self.left -= bytes_
        self.work_left -= work


def pass_allowance() -> Allowance:
    """What every custom loss of one pass (one micro-batch, a joint pass's requests together)
    may take: the worker is shared by every tenant."""
    return Allowance(MAX_PASS_BYTES, MAX_PASS_WORK)


def allowance_for(datums: list[list[Tensor]], within: Allowance | None = None) -> Allowance:
    """What the losses of ``datums`` (each its logprobs and inputs) may take: as if every node of
    a largest graph held a value the size of its datum's inputs, and each read its inputs
    ``WORK_PER_ELEMENT`` times, within the pass's bounds."""
    held = sum(v.numel() * v.element_size() for values in datums for v in values)
    elements = sum(v.numel() for values in datums for v in values)
    bytes_ = min(MAX_PASS_BYTES, max(MIN_PASS_BYTES, MAX_NODES * held))
    return Allowance(bytes_, min(MAX_PASS_WORK, max(MIN_WORK, WORK_PER_ELEMENT * elements)), within)


def _check_size(node: _Node, a: list, kw: dict, budget: int, allowance: Allowance) -> None:
    """The size of what ``node`` would make, found on the meta device (shapes, no data), checked
    against the bounds before the node runs: an outer product of two long vectors is refused,
    not allocated. A shape that depends on the data (a boolean mask's selection) is taken at its
    largest, every element selected; a node the meta device cannot run is refused with its error
    (a node of numbers only has nothing to size)."""
    operands = _tensors([a, kw])
    if node.target in _NUMBER_RESULTS or not operands:
        return
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]  # installed at import
        meta = _apply(node, _on_meta(a), _on_meta(kw))
    made = _tensors(meta)
    largest = max((t.numel() for t in made), default=0)
    broadcast = _broadcast_numel([v for v in (*a, *kw.values()) if isinstance(v, Tensor)])
    if max(largest, broadcast) > budget:
        what = "a value" if largest >= broadcast else "its operands broadcast to"
        raise CustomLossError(f"{what} {max(largest, broadcast)} elements, over this datum's bound of {budget}")
    work = sum(t.numel() for t in operands) + sum(t.numel() for t in made) + broadcast
    allowance.take(sum(t.numel() * t.element_size() for t in made), work)


def _broadcast_numel(tensors: list[Tensor]) -> int:
    """The elements two or more operands broadcast to (0: fewer, or shapes that do not broadcast)."""
    if len(tensors) < 2:
        return 0
    try:
        return math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:
        return 0


def _on_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("meta")
    if isinstance(value, torch.device):  # ``.to(device)``: a copy's size, not a copy
        return torch.device("meta")
    if isinstance(value, list | tuple):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _bounded(value: Any, budget: int) -> Any:
    if isinstance(value, Tensor) and value.numel() > budget:
        raise CustomLossError(f"a value of {value.numel()} elements is over this datum's bound of {budget}")
    if isinstance(value, int) and abs(value) >= 2**63:
        raise CustomLossError("an integer over 64 bits")
    return value


def compile_loss(name: str, inputs: list[tuple[str, int]], nodes: list[dict]) -> CustomLoss:
    """Check a graph the SDK sent (``CustomLossGraph.nodes`` as dicts) against the allowed
    operations; ``CustomLossError`` names the first node that is not allowed."""
    if not inputs or inputs[0] != ("logprobs", inputs[0][1]) or inputs[0][1] not in (1, 2):
        raise CustomLossError("inputs: the first input is logprobs, of rank 1 or 2")
    if len(inputs) > MAX_INPUTS:
        raise CustomLossError(f"inputs: at most {MAX_INPUTS}, logprobs included")
    for input_name, rank in inputs:
        if not _INPUT_NAME.fullmatch(input_name) or rank not in (0, 1, 2):
            raise CustomLossError(f"inputs: {input_name!r} of rank {rank} (lowercase names, ranks 0, 1 or 2)")
    if len({n for n, _ in inputs}) != len(inputs):
        raise CustomLossError("inputs: names repeat")
    if len(nodes) > MAX_NODES:
        raise CustomLossError(f"graph: {len(nodes)} nodes, over the limit of {MAX_NODES}")
    placeholders = [n.get("name") for n in nodes if n.get("op") == "placeholder"]
    if placeholders != [n for n, _ in inputs]:
        raise CustomLossError(f"graph: its placeholders {placeholders} are not the inputs {[n for n, _ in inputs]}")
    known: set[str] = set()
    built = []
    for i, raw in enumerate(nodes):
        node = _node(raw, i, known)
        known.add(node.name)
        built.append(node)
    if not built or built[-1].op != "output":
        raise CustomLossError("graph: the last node must be its output")
    used = _used(built)
    return CustomLoss(name, tuple(CustomLossInput(n, r) for n, r in inputs), used, _last_uses(used))


def _refs(value: Any) -> list[str]:
    if isinstance(value, _Ref):
        return [value.name]
    if isinstance(value, list | tuple):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, slice):
        return _refs([value.start, value.stop, value.step])
    return []


def _used(nodes: list[_Node]) -> tuple[_Node, ...]:
    """The placeholders and the nodes the output reads, directly or not (no node has an effect
    of its own: the rest would be work for nothing)."""
    wanted = {nodes[-1].name}
    for node in reversed(nodes):
        if node.name in wanted:
            wanted.update(_refs([node.args, node.kwargs]))
    return tuple(n for n in nodes if n.op == "placeholder" or n.name in wanted)


def _last_uses(nodes: tuple[_Node, ...]) -> tuple[tuple[str, ...], ...]:
    """By node, the values whose last reader it is."""
    last: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in _refs([node.args, node.kwargs]):
            last[name] = index
    done: list[list[str]] = [[] for _ in nodes]
    for name, index in last.items():
        done[index].append(name)
    return tuple(tuple(names) for names in done)


def _node(raw: dict, index: int, known: set[str]) -> _Node:
    where = f"graph.nodes[{index}]"
    op, name, target = raw.get("op"), raw.get("name"), raw.get("target")
    if not isinstance(name, str) or not name or name in known:
        raise CustomLossError(f"{where}: a node needs a name of its own, got {name!r}")
    args = _decode(raw.get("args", []), known, f"{where}.args")
    kwargs = _decode({"dict": raw.get("kwargs", {})}, known, f"{where}.kwargs")
    if writes := WRITING_KWARGS & set(kwargs):
        raise CustomLossError(f"{where} ({name}): {sorted(writes)[0]}= is not allowed: a node makes new values only")
    if op == "placeholder" or op == "output":
        return _Node(op, name, target, tuple(args), kwargs)
    if op == "call_function":
        fn = FUNCTIONS.get(target) if isinstance(target, str) else None
        if fn is None:
            raise CustomLossError(f"{where} ({name}): calling {target!r} is not allowed in a custom loss")
        if fn in _INPLACE_SECOND and len(args) > 1:
            raise CustomLossError(f"{where} ({name}): inplace= is not allowed: a node makes new values only")
        return _Node(op, name, fn, tuple(args), kwargs)
    if op == "call_method":
        if target not in METHODS:
            raise CustomLossError(f"{where} ({name}): method {target!r} is not allowed in a custom loss")
        if not args:
            raise CustomLossError(f"{where} ({name}): a method call needs its tensor")
        return _Node(op, name, target, tuple(args), kwargs)
    raise CustomLossError(f"{where} ({name}): {op!r} nodes are not allowed (no modules, no captured tensors)")


def _decode(value: Any, known: set[str], where: str, depth: int = 0) -> Any:
    """The SDK's argument encoding (``CustomLossNode.args``) back to values; a ``ref`` becomes
    ``_Ref`` (resolved when the graph runs) and must name an earlier node."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth > MAX_DEPTH:
        raise CustomLossError(f"{where}: arguments nested over {MAX_DEPTH} deep")
    if isinstance(value, list):
        if len(value) > MAX_ARGS:
            raise CustomLossError(f"{where}: a list of {len(value)} arguments, over {MAX_ARGS}")
        return [_decode(v, known, where, depth + 1) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise CustomLossError(f"{where}: cannot decode {value!r}")
    ((kind, inner),) = value.items()
    if kind == "ref":
        if inner not in known:
            raise CustomLossError(f"{where}: refers to {inner!r}, which is not an earlier node")
        return _Ref(inner)
    if isinstance(inner, list | dict) and len(inner) > MAX_ARGS:
        raise CustomLossError(f"{where}: {len(inner)} arguments, over {MAX_ARGS}")
    if kind == "tuple" and isinstance(inner, list):
        return tuple(_decode(v, known, where, depth + 1) for v in inner)
    if kind == "dict" and isinstance(inner, dict):
        return {str(k): _decode(v, known, where, depth + 1) for k, v in inner.items()}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        return slice(*(_decode(v, known, where, depth + 1) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if kind == "dtype" and inner in _DTYPES:
        return _DTYPES[inner]
    if kind == "device" and isinstance(inner, str):
        return _SameDevice()  # a loss runs where its datum is, whatever device it was traced on
    if kind == "layout" and inner == "strided":
        return torch.strided
    if kind == "memory_format" and inner in ("contiguous_format", "preserve_format"):
        return getattr(torch, inner)
    raise CustomLossError(f"{where}: cannot decode {value!r}")


@dataclass(frozen=True)
class _Ref:
    name: str


class _SameDevice:
    pass


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, env), _resolve(value.stop, env), _resolve(value.step, env))
    if isinstance(value, _SameDevice):
        return next((v.device for v in env.values() if isinstance(v, Tensor)), torch.device("cpu"))
    return value


def _check_result(name: str, result: Any) -> tuple[Tensor, dict[str, Tensor]]:
    if not (isinstance(result, tuple | list) and len(result) == 2 and isinstance(result[1], dict)):
        raise CustomLossError(f"custom loss {name!r} must return (loss, metrics)")
    loss, metrics = result
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise CustomLossError(f"custom loss {name!r} must return a scalar loss, got {shape}")
    if len(metrics) > MAX_METRICS:
        raise CustomLossError(f"custom loss {name!r} returns {len(metrics)} metrics, over {MAX_METRICS}")
    for key, value in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(value, Tensor) or value.numel() != 1:
            raise CustomLossError(
                f"custom loss {name!r}: metric {key!r} must be a scalar tensor named custom/<name>:sum or :mean"
            )
    return loss, metrics


def reduce_metrics(sums: Mapping[str, float], datums: int) -> dict[str, float]:
    """Per-datum metric sums as the client sees them: ``:mean`` ones divided by the datums."""
    return {key: value / datums if key.endswith(":mean") else value for key, value in sums.items()}
