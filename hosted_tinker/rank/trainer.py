"""The Tinker step, written once, over any parallel plan.

What makes a step Tinker's lives here and nowhere else:

- a request's gradients go to fresh buffers and join the accumulated ones only if it succeeded
  on every rank (``plan.all_succeeded``): a failed request leaves no partial gradient anywhere;
- losses are the loss table's plain sums over tokens and datums (``core.losses``), evaluated
  per micro-batch of at most ``microbatch_tokens`` tokens, packed (``core.packing``: no pad
  token is computed), with decoder layers' activations recomputed in the backward pass
  (``layers_to_recompute``: all of them above ``recompute_above_tokens``, or as few as keep
  the rest within ``activation_memory``);
- ``optim_step`` reduces gradients over the ranks (``plan.reduce_gradients``), refuses a
  non-finite norm, clips *to* ``grad_clip_norm`` exactly, and takes a step of the model's
  optimizer (AdamW or Dimuon, ``rank.optimizers``, fixed at creation) with the request's
  hyperparameters;
- the state (weights, optimizer state, step count, the model's RNG) travels as ``AdapterState``
  under PEFT's key names, whole tensors gathered over the plan's model-parallel group.

Called from one thread (the worker's), one call at a time: no locking. Every call either
returns or raises; a failed call leaves the trainer as it was before it (``core.types``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.calls import rank_call
from hosted_tinker.core.custom_loss import Allowance, allowance_for, pass_allowance
from hosted_tinker.core.errors import GroupBroken, PeerFailed, UserError
from hosted_tinker.core.packing import microbatches
from hosted_tinker.core.routing import Routed
from hosted_tinker.core.sharding import every
from hosted_tinker.core.types import (
    AdapterState,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimParams,
    RequestFailed,
    optimizer_family,
)
from hosted_tinker.rank import optimizers
from hosted_tinker.rank.activations import SavedBytes, free_device_bytes, layers_to_store
from hosted_tinker.rank.model import AdapterHandle, LoraModel, SplitDim
from hosted_tinker.rank.plans import ParallelPlan

log = logging.getLogger(__name__)

GIB = 2**30
# activation_memory=auto: what a pass may not count on of the GPU's free memory: the output
# layer's chunks (``core.logprobs``, ~256 MB of float32 logits and their gradient) and the
# allocator's fragments
AUTO_RESERVE_BYTES = 2 * GIB
AUTO_FREE_FRACTION = 0.9


class _Outcome:
    """One request's results, gathered over the micro-batches that hold its datums."""

    def __init__(self, batch: ForwardBackwardBatch) -> None:
        self.batch = batch
        self.spec = losses.LOSSES.get(batch.loss_fn)
        self.custom = batch.custom_loss.compile() if batch.custom_loss is not None else None
        self.logprobs: list[np.ndarray | None] = [None] * len(batch.data)
        self.elementwise: list[np.ndarray | None] = [None] * len(batch.data)
        self.metrics: dict[str, float] = {}
        self.loss_sum = 0.0
        self.routed: Routed | None = None  # a mixture-of-experts model's routing (``core.routing``)

    def add_routed(self, routed: Routed) -> None:
        self.routed = routed if self.routed is None else self.routed + routed

    def add(self, scored: list[tuple[int, torch.Tensor]], shared: Allowance) -> torch.Tensor:
        """The loss of some of the request's datums (``(index, log-probs)``), as a 0-d tensor in
        autograd; their log-probs and per-token terms recorded. ``shared``: what the custom
        losses of every request in this pass may hold together."""
        batch = self.batch
        inputs = [{k: v.to(lp.device) for k, v in batch.data[i].inputs.items()} for i, lp in scored]
        terms: list[torch.Tensor | None]
        if self.custom is None:
            if self.spec is None:  # the gateway refuses an unknown loss first
                raise UserError(f"unknown loss_fn {batch.loss_fn!r}")
            spec = self.spec
            per_token = [spec.fn(lp, x, batch.loss_config) for (_, lp), x in zip(scored, inputs, strict=True)]
            loss = functools.reduce(operator.add, (t.sum() for t in per_token))  # as sum() adds, from the first
            terms = list(per_token)
        else:  # one scalar per datum, and its metrics: no per-token terms
            terms = [None] * len(scored)
            loss = torch.zeros((), device=scored[0][1].device)
            # What all these datums' graphs may hold, until their backward.
            datums = [[lp, *x.values()] for (_, lp), x in zip(scored, inputs, strict=True)]
            allowance = allowance_for(datums, within=shared)
            for (_, lp), x in zip(scored, inputs, strict=True):
                value, datum_metrics = self.custom(lp, x, allowance)
                loss = loss + value
                for key, m in datum_metrics.items():
                    self.metrics[key] = self.metrics.get(key, 0.0) + float(m.detach())
        self.loss_sum += float(loss.detach())
        for (i, lp), t in zip(scored, terms, strict=True):
            self.logprobs[i] = lp.detach().float().cpu().numpy()
            self.elementwise[i] = None if t is None else t.detach().float().cpu().numpy()
        return loss

    def result(self) -> ForwardBackwardResult:
        return ForwardBackwardResult(every(self.logprobs), self.loss_sum, self.elementwise, self.metrics, self.routed)


@dataclass
class _Adapter:
    spec: LoraSpec
    handle: AdapterHandle
    optimizer: optimizers.Optimizer
    generator: torch.Generator  # the model's own randomness; checkpointed with it
    steps: int = 0


class Trainer:
    SERVED_AS = "trainer"  # its name in calls to the worker (``rank.serve.Rank``)

    def __init__(
        self,
        model: LoraModel,
        plan: ParallelPlan,
        microbatch_tokens: int = 16384,
        recompute_above_tokens: int = 8192,
        activation_memory: float | Literal["auto"] | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.microbatch_tokens = microbatch_tokens
        self.recompute_above_tokens = recompute_above_tokens
        self.activation_memory = activation_memory  # bytes, "auto" or None (``layers_to_recompute``)
        self.layer_bytes_per_token: float | None = None  # what a stored layer keeps, once measured
        self._measured_tokens = 0  # the micro-batch it was measured on (the largest so far)
        self.adapters: dict[str, _Adapter] = {}

    # ---- adapters ---------------------------------------------------------------------------

    @rank_call("every", model="creates")
    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        """Created on every rank or on none; then its initial weights are the same everywhere."""
        failure: Exception | None = None
        try:
            if model_id in self.adapters:
                raise UserError(f"model {model_id} already exists")
            handle = self.model.add_adapter(lora)
            generator = torch.Generator().manual_seed(lora.seed)
            self.adapters[model_id] = _Adapter(lora, handle, self._new_optimizer(lora, handle), generator)
        except Exception as e:
            failure = e
        error = self._failure_anywhere(failure)
        if error is not None:
            if failure is None:  # made here, not elsewhere
                self.delete_adapter(model_id)
            raise error
        handle = self.adapters[model_id].handle
        self.plan.broadcast_initial(handle.params, handle.split_dims)

    @rank_call("every", model="deletes")
    def delete_adapter(self, model_id: str) -> None:
        adapter = self._adapter(model_id)
        del self.adapters[model_id]
        self.model.remove_adapter(adapter.handle)

    @rank_call("first")
    def has_adapter(self, model_id: str) -> bool:
        return model_id in self.adapters

    def _adapter(self, model_id: str) -> _Adapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise UserError(f"model {model_id} is not loaded") from None

    def _failure_anywhere(self, failure: Exception | None) -> Exception | None:
        """What a call that must succeed everywhere or nowhere raises, its effects undone by the
        caller: its own ``failure``, else ``PeerFailed`` if it failed on another rank, else None."""
        if self.plan.all_succeeded(failure is None):
            return None
        return failure if failure is not None else PeerFailed("another rank failed this request")

    # ---- forward / backward ---------------------------------------------------------------------

    @rank_call("split", model="uses")
    def forward_backward(self, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        # This request's gradients go to fresh buffers and join the accumulated ones only if
        # every micro-batch succeeded on every rank.
        stash: dict[str, list[torch.Tensor | None]] = {}
        failure: Exception | None = None
        try:
            adapter = self._adapter(model_id)
            stash = self._fresh_gradients([model_id])
            result = self._run([(adapter.handle, batch)])[0]
        except Exception as e:
            failure = e
        error = self._failure_anywhere(failure)
        if error is not None:
            self._restore_gradients(stash)
            raise error
        self._join_gradients(stash)
        return result

    @rank_call("split_many")
    def forward_backward_many(
        self, requests: list[tuple[str, ForwardBackwardBatch]]
    ) -> list[ForwardBackwardResult | RequestFailed]:
        """Several models' requests (forward_backward, or all forward-only) in one pass over the
        base: each datum runs under its own model's adapter (``rank.adapters``), each model's
        loss, gradients and metrics are its own, exactly as if it ran alone. If the joint pass
        fails anywhere, nothing of it stays and each request runs alone instead, so that a
        failure is only its own request's."""
        stash: dict[str, list[torch.Tensor | None]] = {}
        failure: Exception | None = None
        try:
            model_ids = [model_id for model_id, _ in requests]
            if len(set(model_ids)) < len(model_ids) or len({b.forward_only for _, b in requests}) > 1:
                raise UserError("a joint pass takes one request per model, all forward-only or none")
            handles = [self._adapter(model_id).handle for model_id in model_ids]
            stash = self._fresh_gradients(model_ids)
            results: list[ForwardBackwardResult | RequestFailed] = list(
                self._run(list(zip(handles, [b for _, b in requests], strict=True)))
            )
        except Exception as e:
            failure = e
        if self._failure_anywhere(failure) is None:
            self._join_gradients(stash)
            return results
        self._restore_gradients(stash)
        return [self._alone(model_id, batch) for model_id, batch in requests]

    def _alone(self, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult | RequestFailed:
        """One request of a failed joint pass, run by itself; its failure as a value."""
        try:
            return self.forward_backward(model_id, batch)
        except (UserError, PeerFailed) as e:
            return RequestFailed("user_error" if isinstance(e, UserError) else "peer_failed", str(e))
        except GroupBroken:
            raise
        except Exception as e:
            log.exception("forward_backward of %s failed", model_id)
            return RequestFailed("error", f"{type(e).__name__}: {e}")

    def _fresh_gradients(self, model_ids: list[str]) -> dict[str, list[torch.Tensor | None]]:
        """Each model's accumulated gradients, set aside: the step computes into fresh buffers."""
        stash = {}
        for model_id in model_ids:
            params = self.adapters[model_id].handle.params
            stash[model_id] = [p.grad for p in params]
            for p in params:
                p.grad = None
        return stash

    def _restore_gradients(self, stash: dict[str, list[torch.Tensor | None]]) -> None:
        for model_id, grads in stash.items():
            for p, g in zip(self.adapters[model_id].handle.params, grads, strict=True):
                p.grad = g

    def _join_gradients(self, stash: dict[str, list[torch.Tensor | None]]) -> None:
        for model_id, grads in stash.items():
            for p, g in zip(self.adapters[model_id].handle.params, grads, strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else g.add_(p.grad)

    def _run(self, requests: list[tuple[AdapterHandle, ForwardBackwardBatch]]) -> list[ForwardBackwardResult]:
        """The requests' data, laid end to end, in micro-batches of packed tokens: each
        micro-batch one pass over the base, one backward of the sum of its models' losses (a
        model's loss reaches only its own adapter).

        Ranks whose passes meet inside the layers (``LoraModel.lock_stepped``: expert parallelism,
        where each holds its own shard) run as many passes as the one with the most, the same
        layers recomputed, and every training pass's backward through the layers
        (``finish_pass``); a rank whose pass fails after its layers (the output layer, a loss, their
        backward) goes on with empty passes and raises at the end, so that none is left waiting
        in a layer."""
        owner = [r for r, (_, batch) in enumerate(requests) for _ in batch.data]
        data = [d for _, batch in requests for d in batch.data]
        handles = [requests[r][0] for r in owner]
        first = [sum(len(b.data) for _, b in requests[:r]) for r in range(len(requests))]
        outs = [_Outcome(batch) for _, batch in requests]
        forward_only = requests[0][1].forward_only
        batches = microbatches(data, self.microbatch_tokens)
        batches += [[] for _ in range(self.plan.passes(len(batches)) - len(batches))]
        failure: Exception | None = None
        for indices in batches:
            if failure is not None:
                indices = []  # the others' passes still need this rank's
            tokens = sum(data[i].num_tokens for i in indices)
            # the most any rank of a lock-stepped group asks for (a rank's own where ranks run alone)
            recompute = 0 if forward_only else -int(self.plan.least(-self.layers_to_recompute(tokens)))
            with torch.set_grad_enabled(not forward_only):
                try:
                    chosen = [handles[i] for i in indices], [data[i] for i in indices]
                    with self._measuring(recompute, tokens, forward_only):
                        lps = self.model.logprobs(*chosen, recompute=recompute)
                    routed = self.model.take_routed()  # by adapter: a joint pass has one request per model
                    for r, (handle, _) in enumerate(requests):
                        if handle.name in routed:
                            outs[r].add_routed(routed[handle.name])
                    total: torch.Tensor | None = None
                    shared = pass_allowance()
                    for r in sorted({owner[i] for i in indices}):
                        mine = [(i - first[r], lp) for i, lp in zip(indices, lps, strict=True) if owner[i] == r]
                        loss = outs[r].add(mine, shared)
                        total = loss if total is None else total + loss
                    # a loss free of lp has no gradient
                    if not forward_only and total is not None and total.requires_grad:
                        total.backward()
                except Exception as e:
                    if not self.model.lock_stepped:
                        raise
                    failure = e
                if not forward_only:
                    self.model.finish_pass(failed=failure is not None)
                if self.model.lock_stepped and self.plan.shard_failed(failure is not None) and failure is None:
                    # a rank with this shard failed (its memory, say): all of them go on with filler passes
                    failure = PeerFailed("another rank failed this request")
        if failure is not None:
            raise failure
        return [out.result() for out in outs]

    # ---- activation memory --------------------------------------------------------------------

    def layers_to_recompute(self, tokens: int) -> int:
        """How many of the first decoder layers a training micro-batch of ``tokens`` recomputes
        (``rank.activations``). Without a memory budget: all of them above
        ``recompute_above_tokens``, none below. With one: as few as keep the other layers'
        activations within it, at the bytes per token a stored layer was measured to keep; until
        that is known, only the last layer is stored (and measured)."""
        layers = len(self.model.layers)
        if self.activation_memory is None:
            return layers if tokens > self.recompute_above_tokens else 0
        if self.layer_bytes_per_token is None:
            return layers - 1
        return layers - layers_to_store(tokens, layers, self.layer_bytes_per_token, self._activation_budget())

    def _activation_budget(self) -> float:
        if self.activation_memory is None:  # layers_to_recompute asks only with a budget
            raise ValueError("no activation memory budget")
        if not isinstance(self.activation_memory, str):  # bytes, not "auto"
            return float(self.activation_memory)
        free = free_device_bytes(self.model.device)
        if free is None:  # refused at start-up (PlanOptions.check); a trainer built by hand
            raise ValueError("activation_memory='auto' needs a GPU")
        return self.plan.least(max(free * AUTO_FREE_FRACTION - AUTO_RESERVE_BYTES, 0.0))

    @contextlib.contextmanager
    def _measuring(self, recompute: int, tokens: int, forward_only: bool):
        """Around a training pass under a memory budget that stores a layer and holds more tokens
        than any measured before: measure what a stored layer keeps per token. The largest
        micro-batch's figure is kept (what does not grow with tokens weighs least there); over a
        tensor-parallel group its most, so that the group's ranks go on choosing alike."""
        # not the first layer: its input needs no gradient (the base's embedding), so it keeps less
        stored = self.model.layers[max(recompute, 1) :]
        if forward_only or self.activation_memory is None or tokens <= self._measured_tokens or not stored:
            yield
            return
        adapters = [p for adapter in self.adapters.values() for p in adapter.handle.params]
        with SavedBytes(stored, exclude=adapters) as saved:
            yield
        per_token = -self.plan.least(-saved.bytes / (tokens * len(stored)))
        if per_token > 0:
            self.layer_bytes_per_token, self._measured_tokens = per_token, tokens
            log.info("a stored decoder layer keeps %.0f bytes per token (%d tokens)", per_token, tokens)
        elif self.layer_bytes_per_token is None:
            # Nothing seen: layers whose saved tensors no hook sees. Unmeasured, a budget would
            # recompute all layers but the last for good; the token threshold decides instead.
            log.warning(
                "what a stored decoder layer keeps cannot be measured on these layers: the activation memory "
                "budget gives way to recompute_above_tokens (%d)",
                self.recompute_above_tokens,
            )
            self.activation_memory = None

    # ---- optimizer ----------------------------------------------------------------------------

    @rank_call("every", model="uses")
    def optim_step(self, model_id: str, params: OptimParams) -> dict[str, float]:
        adapter = self._adapter(model_id)
        if optimizer_family(params) != adapter.optimizer.family:
            raise UserError(
                f"model {model_id} uses the {adapter.optimizer.family} optimizer (chosen when it was created); "
                f"this step sent {optimizer_family(params)} parameters"
            )
        handle = adapter.handle
        self.plan.reduce_gradients(handle.params, handle.split_dims)
        present = [(p.grad, dim) for p, dim in zip(handle.params, handle.split_dims, strict=True) if p.grad is not None]
        grads = [g for g, _ in present]
        grad_norm = float(self.plan.grad_norm(grads, [dim for _, dim in present])) if grads else 0.0
        if not math.isfinite(grad_norm):
            for p in handle.params:
                p.grad = None
            raise UserError(f"gradient norm is {grad_norm}; the step was skipped and gradients cleared")
        if params.grad_clip_norm > 0 and grad_norm > params.grad_clip_norm:
            # The SDK documents clipping *to* grad_clip_norm: scale exactly, no epsilon.
            scale = params.grad_clip_norm / grad_norm
            for g in grads:
                g.mul_(scale)
        adapter.optimizer.step(params)
        adapter.steps += 1
        return {"grad_norm": grad_norm, "learning_rate": params.learning_rate, "optimizer_step": float(adapter.steps)}

    # ---- state --------------------------------------------------------------------------------

    @rank_call("every", model="uses")
    def export_state(
        self, model_id: str, *, with_optimizer: bool = True, with_gradients: bool = False
    ) -> AdapterState | None:
        """The whole state on rank 0 (gathered over a model-parallel group); None elsewhere.
        ``with_gradients``: also the gradients not yet applied, summed over the data-parallel
        replicas (each replica keeps 1/replicas of the sum, so that a later step sums it back)."""
        adapter = self._adapter(model_id)
        handle = adapter.handle
        tensors: dict[str, tuple[torch.Tensor, SplitDim]] = {}
        grads: dict[str, tuple[torch.Tensor, SplitDim]] = {}
        if with_gradients:
            self.plan.reduce_gradients(handle.params, handle.split_dims)
        for key, p, dim in zip(handle.keys, handle.params, handle.split_dims, strict=True):
            tensors[key] = (p, dim)
            for field, value in adapter.optimizer.state.get(p, {}).items() if with_optimizer else ():
                tensors[f"{key}.{field}"] = (value, dim if value.shape == p.shape else None)
            if with_gradients and p.grad is not None:
                grads[key] = (p.grad.clone(), dim)
                p.grad.div_(self.plan.replicas_of(dim))
        full = self.plan.gather(tensors)
        gathered = self.plan.gather(grads) if grads else {}
        if full is None:
            return None
        weights = {key: full.pop(key) for key in handle.keys}
        return AdapterState(adapter.spec, weights, full, adapter.steps, adapter.generator.get_state(), gathered or {})

    @rank_call("every", model="uses")
    def snapshot_weights(self, model_id: str) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The adapter's optimizer step count and a copy of its whole tensors, on rank 0 (for a
        sync to an inference engine); None elsewhere."""
        adapter = self._adapter(model_id)
        handle = adapter.handle
        full = self.plan.gather(dict(zip(handle.keys, zip(handle.params, handle.split_dims, strict=True), strict=True)))
        return None if full is None else (adapter.steps, full)

    @rank_call("every", model="replaces")
    def load_state(self, model_id: str, state: AdapterState, *, with_optimizer: bool) -> None:
        adapter = self._adapter(model_id)
        handle = adapter.handle
        fits = set(state.weights) == set(handle.keys)
        shards = {}
        for key, p, dim in zip(handle.keys, handle.params, handle.split_dims, strict=True) if fits else ():
            shards[key] = self.plan.shard(state.weights[key], dim)
            fits = fits and shards[key].shape == p.shape
        if not fits:
            raise UserError(
                f"the checkpoint's adapter (rank {state.lora.rank}, {len(state.weights)} tensors) does not fit model "
                f"{model_id} (rank {adapter.spec.rank}, {len(handle.keys)} tensors): LoRA rank, targets or base model "
                "differ"
            )
        if with_optimizer and state.lora.optimizer != adapter.spec.optimizer:
            raise UserError(
                f"the checkpoint holds {state.lora.optimizer} optimizer state, but model {model_id} uses "
                f"{adapter.spec.optimizer}: load its weights only, or create the model from the checkpoint"
            )
        with torch.no_grad():
            for key, p in zip(handle.keys, handle.params, strict=True):
                p.copy_(shards[key])
                p.grad = None
        adapter.optimizer = self._new_optimizer(adapter.spec, handle)
        adapter.steps = 0
        if with_optimizer:
            for key, p, dim in zip(handle.keys, handle.params, handle.split_dims, strict=True):
                moments = {
                    f: state.optimizer[f"{key}.{f}"]
                    for f in adapter.optimizer.STATE_FIELDS
                    if f"{key}.{f}" in state.optimizer
                }
                if moments:
                    adapter.optimizer.state[p] = {
                        f: self.plan.shard(v, dim).to(p.device) if f != "step" else v for f, v in moments.items()
                    }
            adapter.steps = state.steps
            adapter.generator.set_state(state.rng_state)
        with torch.no_grad():  # a parked model's unapplied gradients: 1/replicas of them on each replica
            for key, p, dim in zip(handle.keys, handle.params, handle.split_dims, strict=True):
                if key in state.gradients:
                    grad = self.plan.shard(state.gradients[key], dim).to(p.device, p.dtype)
                    p.grad = grad / self.plan.replicas_of(dim)

    def _new_optimizer(self, lora: LoraSpec, handle: AdapterHandle) -> optimizers.Optimizer:
        # Hyperparameters come with each step.
        return optimizers.create(lora.optimizer, handle.params, handle.split_dims, lora.rank, self.plan)

    @rank_call("first")
    def zero_adapter(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """A PEFT adapter on the base model whose update is zero (``rank.model.zero_adapter``)."""
        return self.model.zero_adapter()

    @rank_call("first", model="uses")
    def peft_config(self, model_id: str) -> dict:
        """The adapter's ``adapter_config.json`` contents, as PEFT writes it."""
        return self.model.adapter_config(self._adapter(model_id).handle)
