"""The embedded sampler: rank 0's inference engine, fed adapter tensors as vLLM is.

It is not part of training. It holds its own module tree over the base weights it is given (the
training model's, shared, or a model of its own) and its own PEFT adapters, loaded from saved
sampler weights (a config and tensors), least recently used first out. Whatever plan trains the
adapters, this samples them the same way.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from hosted_tinker.core.calls import rank_call
from hosted_tinker.core.errors import UserError
from hosted_tinker.core.sampling import Admission, SampleOutput, SampleSpec, TokenListener
from hosted_tinker.rank.adapters import PeftAdapters
from hosted_tinker.rank.generate import generate

MAX_SAMPLER_ADAPTERS = 16


class EmbeddedSampler:
    """Samples the base model (``key`` None) or a loaded adapter, batched (``rank.generate``)."""

    SERVED_AS = "sampler"  # its name in calls to the worker (``rank.serve.Rank``)

    def __init__(self, base: nn.Module, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)  # for stop strings
        self.pad_id = base.config.pad_token_id or 0
        self.adapters = PeftAdapters(base)
        self.loaded: OrderedDict[str, str] = OrderedDict()  # key -> adapter name, least recently used first

    @rank_call("first")
    def has_sampler(self, key: str) -> bool:
        return key in self.loaded

    @rank_call("first")
    def load_sampler(self, key: str, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None:
        """Make a saved PEFT adapter available for sampling under ``key`` (cached, LRU)."""
        from peft import LoraConfig

        if key in self.loaded:
            self.loaded.move_to_end(key)
            return
        fields = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora")
        name = self.adapters.add(LoraConfig(**{k: adapter_config[k] for k in fields if k in adapter_config}))
        params = dict(self.adapters.params(name))
        if set(params) != set(weights):
            self.adapters.remove(name)
            raise UserError(f"the adapter at {key} does not fit the served model (its tensors do not match)")
        with torch.no_grad():
            for key_, p in params.items():
                p.copy_(weights[key_])
                p.requires_grad_(False)
        self.loaded[key] = name
        while len(self.loaded) > MAX_SAMPLER_ADAPTERS:
            _, evicted = self.loaded.popitem(last=False)
            self.adapters.remove(evicted)

    @rank_call("first")
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
        return generate(
            self.adapters.lm,
            specs,
            pad_id=self.pad_id,
            decode=self._decode,
            default_seed=_seed,
            admit=admit,
            on_token=on_token,
        )

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _seed() -> int:
    """A request without a seed still gets one, so each of its samples has its own stream."""
    return secrets.randbits(62)
