"""Random training batches for the trainer-level tests (plans, DDP): datums of unequal lengths
with the inputs each loss needs; and the padded path packing replaced, to compare against."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.logprobs import packed_targets, target_logprobs, unpacked
from hosted_tinker.core.types import DatumInput, ForwardBackwardBatch


def random_batch(
    rng: np.random.Generator,
    size: int,
    loss_fn: str = "cross_entropy",
    lengths: tuple[int, int] = (3, 40),
    vocab: int = 500,
) -> ForwardBackwardBatch:
    """``size`` datums whose lengths are drawn from ``[lengths[0], lengths[1])``, tokens from
    ``[10, vocab)``; cross-entropy weights in [0, 1.5), policy-loss logprobs and advantages."""
    data = []
    for n in rng.integers(*lengths, size):
        n = int(n)
        tokens = torch.from_numpy(rng.integers(10, vocab, n + 1))
        if loss_fn == "cross_entropy":
            inputs = {"weights": torch.from_numpy(rng.uniform(0.0, 1.5, n).astype(np.float32))}
        else:
            inputs = {
                "logprobs": torch.from_numpy(rng.uniform(-8.0, -4.0, n).astype(np.float32)),
                "advantages": torch.from_numpy(rng.normal(0.0, 1.0, n).astype(np.float32)),
            }
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = torch.ones(n)
            if loss_fn == "stable_reinforce":  # what the server resolves from provenance spans
                inputs["sampled_mask"] = torch.from_numpy((rng.uniform(size=n) > 0.3).astype(np.float32))
        data.append(DatumInput(tokens=tokens[:-1], target_tokens=tokens[1:], inputs=inputs))
    config = dict(losses.LOSSES[loss_fn].config_defaults)
    return ForwardBackwardBatch(data=data, loss_fn=loss_fn, loss_config=config, forward_only=False)


def padded_logprobs(model, handles, data: list[DatumInput], **_) -> list[torch.Tensor]:
    """The path packing replaced, for comparison: ``HfLoraModel``'s data (of one model) right-
    padded into one ``(count, longest)`` batch with an attention mask, through transformers' own
    sdpa attention, then the real positions' target log-probs. Takes the place of
    ``HfLoraModel.logprobs``."""
    (handle,) = {h.name: h for h in handles}.values()
    for p in handle.params:
        p.requires_grad_(True)
    lm = model.adapters.lm
    longest = max(d.num_tokens for d in data)
    model.adapters.routes.everything(handle.name)  # every row, whole (an MoE block sees them flattened)
    ids = torch.zeros((len(data), longest), dtype=torch.long)
    mask = torch.zeros((len(data), longest), dtype=torch.long)
    for row, d in enumerate(data):
        ids[row, : d.num_tokens] = d.tokens
        mask[row, : d.num_tokens] = 1
    packed_implementation = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa" if lm._supports_sdpa else "eager")  # gpt-oss: eager only
    try:
        decoder = getattr(lm, lm.base_model_prefix)
        hidden = decoder(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).last_hidden_state
    finally:
        lm.set_attn_implementation(packed_implementation)
    flat_hidden = hidden[mask.to(model.device).bool()]  # (ΣN, H), datum order
    targets = packed_targets(data).to(model.device)
    head = model.adapters.routes.head(lm.get_output_embeddings(), handle.name)
    return unpacked(target_logprobs(head, flat_hidden, targets), data)


def padded_microbatches(data: list[DatumInput], budget: int) -> list[list[int]]:
    """Datum indices grouped as the padded path grouped them: (count × longest) ≤ ``budget``."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, d in enumerate(data):
        longest_if = max(longest, d.num_tokens)
        if current and longest_if * (len(current) + 1) > budget:
            batches.append(current)
            current, longest_if = [], d.num_tokens
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


@contextmanager
def padded_path(trainer) -> Iterator[None]:
    """While inside, ``trainer`` (on an ``HfLoraModel``) runs the padded path: padded
    micro-batches, padded forward, every activation stored."""
    from hosted_tinker.rank import trainer as trainer_module

    saved = trainer.model.logprobs, trainer.recompute_above_tokens, trainer_module.microbatches
    trainer.model.logprobs = functools.partial(padded_logprobs, trainer.model)
    trainer.recompute_above_tokens = 10**12
    trainer_module.microbatches = padded_microbatches
    try:
        yield
    finally:
        trainer.model.logprobs, trainer.recompute_above_tokens, trainer_module.microbatches = saved
