"""``McoreLoraModel``: the ``LoraModel`` of the ``megatron`` plan. The HF base model as a
megatron-core ``GPTModel`` sharded over the tensor-parallel group (``convert``), LoRA adapters on
its parallel layers (``lora``), and per-token log-probs from vocab-parallel logits (``vocab``).

Every rank of a tensor-parallel group runs the same batch; each holds ``1/tp`` of the base and of
each adapter's sharded tensors. The process group and megatron's parallel state are the plan's
(``rank.plans.megatron``); this module only builds on them.

A mixture-of-experts model's expert-parallel ranks run different shards of a batch, and meet in
every MoE layer, whose dispatcher gathers the tokens of the whole tensor×expert-parallel group
(``token_group``) and needs as many from each rank: a pass is padded to the group's longest
with filler sequences under no adapter, and every training pass runs the decoder's backward
(``finish_pass``), so that the ranks' collectives pair up whatever each rank's shard holds. The
decoder's backward is held back from the loss's: the loss backpropagates to the decoder's output
alone (the output layer and the losses meet no other rank), and ``finish_pass`` takes it through
the layers, with a zero gradient where this rank's losses failed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hosted_tinker.core.errors import GroupBroken, UserError
from hosted_tinker.core.logprobs import chunk_tokens_for, packed_targets, target_logprobs, unpacked
from hosted_tinker.core.packing import pack
from hosted_tinker.core.routing import Routed
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.activations import recomputed
from hosted_tinker.rank.adapters import lora_config, segments
from hosted_tinker.rank.experts import RoutingCounter
from hosted_tinker.rank.mcore.convert import HfShape, transformer_config
from hosted_tinker.rank.mcore.experts import ExpertsSite
from hosted_tinker.rank.mcore.lora import Adapter, Site, TpLora, group_of, init_adapter, whole_sequence
from hosted_tinker.rank.mcore.specs import block_spec
from hosted_tinker.rank.mcore.vocab import vocab_parallel_logprobs
from hosted_tinker.rank.mcore.weights import HfWeights
from hosted_tinker.rank.model import AdapterHandle, load_base, zero_adapter
from hosted_tinker.rank.plans.ddp import collective


class McoreLoraModel:
    def __init__(
        self,
        model_path: str,
        *,
        tp: int,
        tp_rank: int,
        device: str,
        dtype: str,
        lora_alpha: float,
        lora_compute: str = "float32",
        sampler_base: bool = False,
        sequence_parallel: bool = False,
        te: bool = False,
        ep: int = 1,
        ep_rank: int = 0,
        token_group: dist.ProcessGroup | None = None,
        shape: HfShape | None = None,
    ) -> None:
        """``sampler_base``: also load the whole HF base model, for an embedded sampler on this
        rank (``rank.sampler``; it gets adapter tensors gathered whole, in PEFT's keys).
        ``sequence_parallel``: activations between the parallel layers split by sequence.
        ``te``: transformer-engine layers (CUDA only) rather than megatron-core's PyTorch ones.
        ``ep``, ``ep_rank``: the expert-parallel group's size and this rank's place in it;
        ``token_group``: the tensor×expert-parallel group (where ``ep`` > 1); ``shape``: the
        checkpoint's, if the caller has read it."""
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel

        from hosted_tinker.rank.mcore import cpu, without_transformer_engine

        without_transformer_engine()
        self.device = torch.device(device)
        if self.device.type == "cpu":
            cpu.use_cpu()
        shape = shape or HfShape.read(model_path)
        shape.check_tp(tp)
        shape.check_ep(ep, tp, sequence_parallel)
        self.shape, self.tp, self.tp_rank = shape, tp, tp_rank
        self.model_path = model_path
        self.token_group = token_group if ep > 1 else None
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's RNG tracker; no dropout draws from it
        self.gpt = GPTModel(
            transformer_config(shape, tp, getattr(torch, dtype), sequence_parallel, ep),
            block_spec(shape, shape.layers, te),
            vocab_size=shape.vocab,
            max_sequence_length=shape.max_positions,
            share_embeddings_and_output_weights=shape.tied,
            # YaRN's frequencies (gpt-oss); latent attention makes its own rotary embedding
            position_embedding_type="yarn" if shape.yarn is not None and shape.latent is None else "rope",
            rotary_base=int(shape.rope_theta),
            rotary_percent=shape.hybrid.rotary_percent if shape.hybrid is not None else 1.0,
            parallel_output=True,  # each rank keeps its vocabulary slice of the logits
        )
        weights = HfWeights(model_path, shape, tp, tp_rank, ep, ep_rank).state_dict()
        if unloaded := sorted({name for name, _ in self.gpt.named_parameters()} - weights.keys()):
            # strict=False only for megatron's own buffers (_extra_state): a parameter left at
            # its random initial value would be a different model, silently
            raise ValueError(f"no HF weight converts to megatron's {', '.join(unloaded[:5])}")
        self.gpt.load_state_dict(weights, strict=False)
        if shape.score == "sigmoid":  # HF keeps DeepSeek's router in float32 whatever the model's dtype
            for name, param in self.gpt.named_parameters():
                if name.endswith(".mlp.router.weight"):
                    param.data = weights[name].float()
        self.gpt.to(self.device).eval()
        self.gpt.requires_grad_(False)
        self.layers = list(self.gpt.decoder.layers)
        self.arch = shape.causal_lm
        self.family = shape.family
        self.routed_experts = shape.experts
        self.linear_attention_layers = sum(shape.linear(i) for i in range(shape.layers))
        self.vocab_size = shape.vocab
        self.max_positions = shape.max_positions
        self.pad_id = 0  # fills a sequence-parallel stream to a multiple of tp, as its own sequence
        self.lora_alpha = lora_alpha
        self.lora = TpLora(self.gpt, shape, tp, sequence_parallel, lora_compute, ep, ep_rank, self.token_group)
        moe = self.lora.experts
        self.replay_routing = (moe.layers, moe.top_k) if moe is not None else (0, 0)
        self.moe_layers = tuple(i for i in range(shape.layers) if shape.moe(i))
        self.lora_groups = tuple(
            sorted({group_of(name) for name in self.lora.sites}, key=("attn", "mlp", "unembed").index)
        )
        self.lora_params_per_rank: dict[str, int] = {}  # each HF projection's A (r, in) and B (out, r)
        for name, site in self.lora.sites.items():
            group = group_of(name)
            if isinstance(site, ExpertsSite):
                count = site.params_per_rank()
            else:
                count = len(site.out_features) * site.in_features + sum(site.out_features)
            self.lora_params_per_rank[group] = self.lora_params_per_rank.get(group, 0) + count
        self.routing = RoutingCounter(self._routed_segments)
        # Under sequence parallelism a rank's routers see only its part of the pass's tokens: those
        # positions of the stream (None: all of them).
        self._local: slice | None = None
        if self.lora.experts is not None:
            self.lora.experts.routing = self.routing
        # Under expert parallelism every pass must reach a backward through every MoE layer, also
        # one whose tokens touch no adapter (a filler pass): a zero added to the embedding's output
        # that requires a gradient puts every layer in every pass's graph (``finish_pass``).
        self._anchor: nn.Parameter | None = None
        self._held: tuple[Tensor, Tensor] | None = None  # (the decoder's output, its detached copy)
        self.lock_stepped = self.token_group is not None
        if self.lock_stepped:
            self._anchor = nn.Parameter(torch.zeros((), dtype=getattr(torch, dtype), device=self.device))
            self.gpt.embedding.register_forward_hook(lambda module, args, out: out + self._anchor)
        self.sequence_parallel = sequence_parallel
        self.te = te
        self._next = 0
        self.shareable_base = load_base(model_path, self.device, dtype) if sampler_base else None

    # ---- adapters ------------------------------------------------------------------------------

    def add_adapter(self, spec: LoraSpec) -> AdapterHandle:
        # Numbered before anything can fail: the trainer adds on every rank, and a rank that failed
        # here must still count it, or the ranks' numbers would part and a token gathered from
        # another rank (``experts``) would run under the adapter its number names here.
        number = self._next
        self._next += 1
        if self.lock_stepped:
            self._check_numbering(number)
        wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        chosen = {name: site for name, site in self.lora.sites.items() if wanted[group_of(name)]}
        if not chosen:
            raise UserError("lora_config enables no trainable module (train_attn/train_mlp/train_unembed)")
        projections = init_adapter(chosen, spec.rank, self.tp, self.tp_rank, spec.seed)
        for projection in _in_peft_order(projections):
            for param in (projection.A, projection.B):
                param.data = param.data.to(self.device)
                param.requires_grad_(True)
        name = f"a{number}"
        self.lora.adapters[name] = Adapter(projections, self.lora_alpha / spec.rank, number)
        keys, params, split_dims = [], [], []
        for projection in _in_peft_order(projections):
            for matrix, param, dim in zip("AB", (projection.A, projection.B), projection.split_dims, strict=True):
                keys.append(f"base_model.model.{projection.module}.lora_{matrix}.weight")
                params.append(param)
                split_dims.append(dim)
        return AdapterHandle(name, keys, params, split_dims)

    def _check_numbering(self, number: int) -> None:
        """That every rank of the token group gives a new adapter the same number (their tokens
        are routed to expert LoRA by it): one all-reduce, before anything here can fail. A rank
        out of step breaks the group (it is replaced) rather than train one tenant's tokens under
        another's adapter."""
        with collective("the expert-parallel group's agreement on a new adapter's number"):
            both = torch.tensor([number, -number], dtype=torch.long, device=self.device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.token_group)
            most, least = int(both[0]), -int(both[1])
        if most != least:
            raise GroupBroken(f"the ranks numbered a new adapter {least}..{most}: their adapters are out of step")

    def remove_adapter(self, handle: AdapterHandle) -> None:
        self.lora.adapters.pop(handle.name, None)

    def adapter_config(self, handle: AdapterHandle) -> dict:
        """PEFT's ``adapter_config.json`` for the same modules on the HF model."""
        adapter = self.lora.adapters[handle.name]
        modules = [p.module for p in _in_peft_order(adapter.projections)]
        rank = next(iter(adapter.projections.values()))[0].A.shape[0]
        return lora_config(rank, self.lora_alpha, modules, self.model_path)

    def take_routed(self) -> dict[str, Routed]:
        layers = [site.module for site in self.lora.sites.values() if isinstance(site, ExpertsSite)]
        taken = self.routing.take(layers)
        return taken if self._local is None else self._summed_over_tp(taken, len(layers))

    def _summed_over_tp(self, taken: dict[str, Routed], layers: int) -> dict[str, Routed]:
        """The pass's routing summed over the tensor-parallel group, whose ranks each routed their
        part of the same tokens (rank 0's answer is the replica's); by the pass's adapters, the
        same on each rank."""
        from megatron.core import parallel_state

        experts = self.shape.experts
        names = sorted({name for _, _, name in self.lora.routes.segments})  # the pass's, as every rank has them
        sums = torch.zeros(len(names), layers * experts + 2, dtype=torch.float64)
        for i, name in enumerate(names):
            if (routed := taken.get(name)) is not None:
                sums[i, :-2] = torch.from_numpy(routed.counts.reshape(-1))
                sums[i, -2:] = torch.tensor([routed.replayed, routed.changed], dtype=torch.float64)
        with collective("the tensor-parallel group's sum of a pass's routing"):
            sums = sums.to(self.device)
            dist.all_reduce(sums, group=parallel_state.get_tensor_model_parallel_group())
            summed = sums.cpu().round().long()
        out = {}
        for name, row in zip(names, summed, strict=True):
            counts = row[:-2].view(layers, experts).numpy()
            if counts.any():
                out[name] = Routed(counts, int(counts.sum()) // self.shape.top_k, int(row[-2]), int(row[-1]))
        return out

    def _routed_segments(self) -> list[tuple[int, int | None, str]]:
        """The adapters' spans of the tokens this rank's routers see (``RoutingCounter``)."""
        segments = self.lora.routes.segments
        if self._local is None:
            return segments
        low, high = self._local.start, self._local.stop
        out: list[tuple[int, int | None, str]] = []
        for start, end, name in segments:
            first, last = max(start, low), min(high if end is None else end, high)
            if first < last:
                out.append((first - low, last - low, name))
        return out

    def finish_pass(self, failed: bool) -> None:
        """Lock-stepped: the last training pass's backward through the decoder, from the gradient
        its losses left on the decoder's output (zero if ``failed``, or if no loss reached it).
        After it, the pass's routing replay is let go."""
        if self._held is not None:
            (hidden, detached), self._held = self._held, None
            grad = detached.grad if detached.grad is not None and not failed else torch.zeros_like(hidden)
            hidden.backward(grad)
            if self._anchor is not None:
                self._anchor.grad = None  # a zero: nothing to keep
        if self.lora.experts is not None:
            self.lora.experts.clear()

    def zero_adapter(self) -> tuple[dict, dict[str, Tensor]]:
        site = next(site for site in self.lora.sites.values() if isinstance(site, Site))  # layer 0's first
        return zero_adapter(site.hf_modules[0], site.out_features[0], site.in_features, self.model_path)

    # ---- scoring -------------------------------------------------------------------------------

    def logprobs(self, handles: list[AdapterHandle], data: list[DatumInput], *, recompute: int = 0) -> list[Tensor]:
        from megatron.core.packed_seq_params import PackedSeqParams

        self._held, self._local = None, None
        packed = pack(data)
        tokens, positions, cu_seqlens = packed.tokens, packed.positions, packed.cu_seqlens
        total = tokens.shape[0]
        short, longest = self._filler(total, packed.max_len)
        if total + short == 0:  # no rank of the group has a token: no pass
            return []
        if short:  # sequences of pad tokens, seen by nothing else, none longer than the group's longest
            pieces = [min(longest, short - start) for start in range(0, short, longest)]
            tokens = torch.cat([tokens, torch.full((short,), self.pad_id, dtype=torch.long)])
            positions = torch.cat([positions, *(torch.arange(n) for n in pieces)])
            ends = total + torch.tensor(pieces, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            cu_seqlens = torch.cat([cu_seqlens, ends])
        names = [h.name for h in handles] + ([""] if short else [])  # "": no adapter on the filler
        self.lora.routes.segments = segments(names, [d.num_tokens for d in data] + ([short] if short else []))
        if self.lora.experts is not None:
            stream = total + short
            local = slice(None)
            if self.sequence_parallel:  # the MoE layers see this rank's positions of the stream
                part = stream // self.tp
                local = self._local = slice(self.tp_rank * part, (self.tp_rank + 1) * part)
            self.lora.experts.gather_routes(self.lora.token_adapters(stream)[local].to(self.device))
            self.lora.experts.replay(
                [d.routing for d in data] + [None] * bool(short),
                [d.num_tokens for d in data] + [short] * bool(short),
                self.device,
                local,
            )
        on: dict[str, Any] = {"device": self.device}
        # transformer-engine reads the bounds on the device. Megatron's own layers (its unfused
        # RoPE, our attention) read them in Python in every layer: on the host they make no layer
        # wait for the GPU (a device tensor's .tolist() would).
        bounds = cu_seqlens.to(**on) if self.te else cu_seqlens
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            max_seqlen_q=max(packed.max_len, min(short, longest)),
            max_seqlen_kv=max(packed.max_len, min(short, longest)),
        )
        with recomputed(self.layers, recompute), self._decoder_only(), self._counting_routes():
            hidden = self.gpt(tokens[None].to(**on), positions[None].to(**on), None, packed_seq_params=params)
        if self.lora.experts is not None and not torch.is_grad_enabled():  # no backward will recompute a layer
            self.lora.experts.clear()
        if self.sequence_parallel:  # (S/tp, 1, H): whole on every rank, as a column layer's LoRA sees it
            hidden = whole_sequence(hidden)
        if self.lock_stepped and torch.is_grad_enabled():  # the decoder's backward waits for finish_pass
            detached = hidden.detach().requires_grad_()
            self._held, hidden = (hidden, detached), detached
        if not data:  # a filler pass: this rank's shard had fewer micro-batches than another's
            return []
        hidden = hidden[:total, 0]  # (ΣN, H), datum order, the final norm applied
        targets = packed_targets(data).to(self.device)
        tied = self.gpt.share_embeddings_and_output_weights  # then the embedding's rows are the output's
        weight = self.gpt.shared_embedding_or_output_weight() if tied else self.gpt.output_layer.weight  # (V/tp, H)
        from_logits = functools.partial(vocab_parallel_logprobs, vocab_start=self.tp_rank * weight.shape[0])
        chunk = chunk_tokens_for(weight.shape[0])
        parts = [
            target_logprobs(self.lora.head(name, weight), hidden[s:e], targets[s:e], chunk, from_logits)
            for s, e, name in self.lora.routes.segments
            if s < total  # not the sequence-parallel filler
        ]
        return unpacked(torch.cat(parts), data)

    def _filler(self, total: int, longest: int) -> tuple[int, int]:
        """How many filler tokens a pass of ``total`` tokens whose longest sequence has
        ``longest`` gets: to as many as the token group's most (its MoE layers gather the same
        count from each rank), and to a multiple of ``tp`` under sequence parallelism (the stream
        is split over the ranks); and the length no filler sequence may pass, the group's longest
        sequence (attention's cost grows with the square of a sequence's length: one long filler
        would cost the group more than any rank's own data)."""
        want = total
        if self.token_group is not None:
            with collective("the expert-parallel group's agreement on a pass's length"):
                most = torch.tensor([total, longest], dtype=torch.long, device=self.device)
                dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.token_group)
                want, longest = (int(x) for x in most.tolist())
        if self.sequence_parallel:
            want += -want % self.tp
        return want - total, max(longest, self.tp)

    @contextlib.contextmanager
    def _counting_routes(self) -> Iterator[None]:
        """Routing is counted in the forward pass only (a recomputed layer routes again)."""
        self.routing.active = self.lora.experts is not None
        try:
            yield
        finally:
            self.routing.active = False

    @contextlib.contextmanager
    def _decoder_only(self) -> Iterator[None]:
        """``GPTModel.forward`` returns the decoder's output (its final norm included) rather than
        logits while ``post_process`` is off: megatron's own switch, for a pipeline stage without
        the output layer."""
        self.gpt.post_process = False
        try:
            yield
        finally:
            self.gpt.post_process = True


def _in_peft_order(projections: dict[str, list]) -> list:
    """Projections in the HF model's module order (PEFT's): per layer its attention's (q, k, v, o;
    a Gated-DeltaNet layer's out_proj, then q, k, v and z), its MLP's or experts'; lm_head last.
    Sites are built in that order and fuse in it (``lora.sites``)."""
    return [p for name in projections for p in projections[name]]
