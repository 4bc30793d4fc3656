"""The embedded sampler: rank 0's inference engine, fed adapter tensors as vLLM is.

It is not part of training. It holds its own module tree over the base weights it is given (the
training model's, shared, or a model of its own) and its own adapters (``rank.adapters``),
loaded from saved sampler weights (a PEFT config and tensors), least recently used first out.
Whatever plan trains the adapters, this samples them the same way.
"""

from __future__ import annotations

import math
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from hosted_tinker.core.calls import rank_call
from hosted_tinker.core.errors import UserError
from hosted_tinker.core.pretrained import auto_tokenizer
from hosted_tinker.core.sampling import Admission, FinishListener, SampleOutput, SampleSpec, TokenListener
from hosted_tinker.rank.adapters import KEY_PREFIX, Adapter, Lora, LoraAdapters
from hosted_tinker.rank.experts import PROJECTIONS
from hosted_tinker.rank.generate import Decode, generate
from hosted_tinker.rank.hf import CausalLM
from hosted_tinker.rank.vision import VisionTower

MAX_SAMPLER_ADAPTERS = 16
# Paused runs kept at once (the engine keeps fewer: ``inference.embedded.MAX_LIVE_RUNS``); each
# pins its adapter, so there must be fewer than MAX_SAMPLER_ADAPTERS.
MAX_RUNS = 8
# PEFT LoRA settings that this server's adapters do not have (and never write): refused, not ignored.
UNSUPPORTED = (
    "alpha_pattern",
    "rank_pattern",
    "layers_to_transform",
    "layers_pattern",
    "exclude_modules",
    "modules_to_save",
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "target_parameters",
    "layer_replication",
    "trainable_token_indices",
)


class EmbeddedSampler:
    """Samples the base model (``key`` None) or a loaded adapter, batched (``rank.generate``)."""

    SERVED_AS = "sampler"  # its name in calls to the worker (``rank.serve.Rank``)

    def __init__(
        self, base: CausalLM, model_path: str, lora_compute: str = "float32", vision: VisionTower | None = None
    ) -> None:
        self.vision = vision  # a vision-language model's tower: prompts may hold images
        self.tokenizer = auto_tokenizer(model_path)  # for stop strings
        self.pad_id = base.config.pad_token_id or 0
        self.adapters = LoraAdapters(base, lora_compute)
        self.loaded: OrderedDict[str, str] = OrderedDict()  # key -> adapter name, least recently used first
        self.runs: dict[str, tuple[str | None, Decode]] = {}  # run id -> (its weights' key, its state)

    @rank_call("first")
    def has_sampler(self, key: str) -> bool:
        return key in self.loaded

    @rank_call("first")
    def load_sampler(self, key: str, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None:
        """Make a saved PEFT adapter available for sampling under ``key`` (cached, LRU)."""
        if key in self.loaded:
            self.loaded.move_to_end(key)
            return
        self.loaded[key] = self.adapters.add(self._adapter(key, adapter_config, weights))
        in_use = {weights for weights, _ in self.runs.values()}  # a paused run resumes on its adapter
        for old in [k for k in self.loaded if k not in in_use][: max(len(self.loaded) - MAX_SAMPLER_ADAPTERS, 0)]:
            self.adapters.remove(self.loaded.pop(old))

    def _adapter(self, key: str, config: dict, weights: dict[str, torch.Tensor]) -> Adapter:
        """The adapter that ``config`` and ``weights`` describe, as PEFT would build it on this
        model: LoRA on exactly the linear layers its ``target_modules`` select, each with both
        matrices of rank ``r``; ``UserError`` if they do not fit."""
        misfit = UserError(f"the adapter at {key} does not fit the served model (its tensors do not match)")
        for field in UNSUPPORTED:  # what would change which layers or scales, beyond r and alpha
            if config.get(field) not in (None, False, {}, []):
                raise UserError(f"the adapter at {key} sets {field}, which this server does not apply")
        rank = config.get("r")
        if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none" or not rank:
            raise misfit
        head = self.adapters.lm.get_output_embeddings()
        wanted = config.get("target_modules")
        selected = {
            name
            for name, module in self.adapters.lm.named_modules()
            if isinstance(module, nn.Linear) and targeted(name, wanted, module is head)
        }
        # routed experts' projections (``rank.experts``) and Tinker's q/k/v slices of a fused
        # projection (``rank.linear_attention``): named as modules are, though they are not, and
        # never by ``all-linear`` (PEFT's, which selects linear layers only)
        if not (isinstance(wanted, str) and wanted.lower() == "all-linear"):
            virtual = [f"{experts}.{p}" for experts in self.adapters.experts for p in PROJECTIONS]
            selected |= {target for target in (*virtual, *self.adapters.slices) if targeted(target, wanted, False)}
        device = next(self.adapters.lm.parameters()).device
        layers: dict[str, Lora] = {}
        for module in self.adapters.in_model_order(selected):
            shapes = self.adapters.lora_shapes(module, rank)
            a, b = (weights.get(f"{KEY_PREFIX}{module}.lora_{part}.weight") for part in "AB")
            if a is None or b is None or (tuple(a.shape), tuple(b.shape)) != shapes:
                raise misfit
            a, b = (m.to(device, torch.float32, copy=True) for m in (a, b))  # never the caller's
            layers[module] = Lora(nn.Parameter(a, False), nn.Parameter(b, False))
        if not layers or len(weights) != 2 * len(layers):
            raise misfit
        alpha = config.get("lora_alpha", 8)
        return Adapter(layers, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank))

    @rank_call("first", listeners=("on_token",))
    def generate(
        self,
        key: str | None,
        specs: list[SampleSpec],
        admit: Callable[[], Admission] | None = None,
        on_token: TokenListener | None = None,
    ) -> list[SampleOutput]:
        """Sample ``specs``; between decode steps ``admit`` may hand over more requests on the
        same weights or drop abandoned ones, and ``on_token`` hears each token of a ``stream``
        spec as it is chosen."""
        self.adapters.routes.everything(None if key is None else self.loaded[key])
        return generate(self.adapters.lm, specs, admit=admit, on_token=on_token, **self._decoding())

    @rank_call("first", listeners=("on_token", "on_finished"))
    def decode_slice(
        self,
        run_id: str,
        key: str | None,
        specs: list[SampleSpec],
        admit: Callable[[], Admission],
        on_token: TokenListener | None = None,
        on_finished: FinishListener | None = None,
    ) -> bool:
        """Run ``run_id`` on weights ``key`` until ``admit`` ends its slice (False: it is kept
        here, paused, for the next call) or it ends (True). Its first call brings its ``specs``
        and starts it; ``on_finished`` hears each request's output as soon as it is complete."""
        try:
            if run_id not in self.runs and not specs:  # its state went with a worker that died meanwhile
                raise RuntimeError(f"sampling run {run_id} was lost: the worker restarted while it was paused")
            self.adapters.routes.everything(None if key is None else self.loaded[key])  # as another run left them
            if run_id in self.runs:
                run = self.runs[run_id][1]
            elif len(self.runs) >= MAX_RUNS:
                raise RuntimeError(f"{MAX_RUNS} sampling runs are paused already")
            else:
                run = Decode(self.adapters.lm, specs, **self._decoding())
                self.runs[run_id] = (key, run)
            done = run.run(admit, on_token, on_finished)
        except BaseException:
            self.runs.pop(run_id, None)  # its KV cache with it
            raise
        if done:
            del self.runs[run_id]
        return done

    def _decoding(self) -> dict:
        """What every decode run here is given besides its model and requests."""
        return {
            "vision": self.vision,
            "replay": self.adapters.replay,
            "pad_id": self.pad_id,
            "decode": self._decode,
            "default_seed": _seed,
        }

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))  # one sequence: one string


def _seed() -> int:
    """A request without a seed still gets one, so each of its samples has its own stream."""
    return secrets.randbits(62)


def targeted(module: str, target_modules: str | list[str] | None, is_head: bool) -> bool:
    """Whether PEFT's ``target_modules`` select the linear layer ``module``: a list names modules
    or their last dotted parts, a string is a regular expression over the whole name, and
    ``all-linear`` is every linear layer but the output layer."""
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return not is_head
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules or [])
