"""The Tinker step, written once, over any parallel plan.

What makes a step Tinker's lives here and nowhere else:

- a request's gradients go to fresh buffers and join the accumulated ones only if it succeeded
  on every rank (``plan.all_succeeded``): a failed request leaves no partial gradient anywhere;
- losses are the loss table's plain sums over tokens and datums (``core.losses``), evaluated
  per micro-batch of at most ``microbatch_tokens`` tokens, packed (``core.packing``: no pad
  token is computed), with each decoder layer's activations recomputed in the backward pass
  when a micro-batch holds more than ``recompute_above_tokens``;
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

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hosted_tinker.core import losses
from hosted_tinker.core.calls import rank_call
from hosted_tinker.core.errors import PeerFailed, UserError
from hosted_tinker.core.packing import microbatches
from hosted_tinker.core.types import (
    AdapterState,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimParams,
    optimizer_family,
)
from hosted_tinker.rank import optimizers
from hosted_tinker.rank.model import AdapterHandle, LoraModel
from hosted_tinker.rank.plans import ParallelPlan


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
        self, model: LoraModel, plan: ParallelPlan, microbatch_tokens: int = 16384, recompute_above_tokens: int = 8192
    ) -> None:
        self.model = model
        self.plan = plan
        self.microbatch_tokens = microbatch_tokens
        self.recompute_above_tokens = recompute_above_tokens
        self.adapters: dict[str, _Adapter] = {}

    # ---- adapters ---------------------------------------------------------------------------

    @rank_call("every")
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
        self.plan.broadcast_initial(self.adapters[model_id].handle.params)

    @rank_call("every", model="replaces")
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
        params: list[nn.Parameter] = []
        accumulated: list[torch.Tensor | None] = []
        failure: Exception | None = None
        try:
            adapter = self._adapter(model_id)
            params, accumulated = adapter.handle.params, [p.grad for p in adapter.handle.params]
            for p in params:
                p.grad = None
            result = self._run_batch(adapter.handle, batch)
        except Exception as e:
            failure = e
        error = self._failure_anywhere(failure)
        if error is not None:
            for p, g in zip(params, accumulated, strict=True):
                p.grad = g
            raise error
        for p, g in zip(params, accumulated, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        return result

    def _run_batch(self, handle: AdapterHandle, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        spec = losses.LOSSES.get(batch.loss_fn)
        custom = batch.custom_loss.compile() if batch.custom_loss is not None else None
        logprobs: list[np.ndarray | None] = [None] * len(batch.data)
        elementwise: list[np.ndarray | None] = [None] * len(batch.data)
        metrics: dict[str, float] = {}
        loss_sum = 0.0
        for indices in microbatches(batch.data, self.microbatch_tokens):
            data = [batch.data[i] for i in indices]
            recompute = sum(d.num_tokens for d in data) > self.recompute_above_tokens
            with torch.set_grad_enabled(not batch.forward_only):
                lps = self.model.logprobs(handle, data, recompute=recompute)
                inputs = [{k: v.to(lp.device) for k, v in d.inputs.items()} for lp, d in zip(lps, data, strict=True)]
                if custom is None:
                    terms = [spec.fn(lp, x, batch.loss_config) for lp, x in zip(lps, inputs, strict=True)]
                    loss = sum(t.sum() for t in terms)
                else:  # one scalar per datum, and its metrics: no per-token terms
                    terms, loss = [None] * len(data), torch.zeros((), device=lps[0].device)
                    for lp, x in zip(lps, inputs, strict=True):
                        value, datum_metrics = custom(lp, x)
                        loss = loss + value
                        for key, m in datum_metrics.items():
                            metrics[key] = metrics.get(key, 0.0) + float(m.detach())
                if not batch.forward_only and loss.requires_grad:  # a loss free of lp has no gradient
                    loss.backward()
            loss_sum += float(loss.detach())
            for i, lp, t in zip(indices, lps, terms, strict=True):
                logprobs[i] = lp.detach().float().cpu().numpy()
                elementwise[i] = None if t is None else t.detach().float().cpu().numpy()
        return ForwardBackwardResult(logprobs, loss_sum, elementwise, metrics)

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
        self.plan.reduce_gradients(handle.params)
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
    def export_state(self, model_id: str, *, with_optimizer: bool = True) -> AdapterState | None:
        """The whole state on rank 0 (gathered over a model-parallel group); None elsewhere."""
        adapter = self._adapter(model_id)
        handle = adapter.handle
        tensors: dict[str, tuple[torch.Tensor, int | None]] = {}
        for key, p, dim in zip(handle.keys, handle.params, handle.split_dims, strict=True):
            tensors[key] = (p, dim)
            for field, value in adapter.optimizer.state.get(p, {}).items() if with_optimizer else ():
                tensors[f"{key}.{field}"] = (value, dim if value.shape == p.shape else None)
        full = self.plan.gather(tensors)
        if full is None:
            return None
        weights = {key: full.pop(key) for key in handle.keys}
        return AdapterState(adapter.spec, weights, full, adapter.steps, adapter.generator.get_state())

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
