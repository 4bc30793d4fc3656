"""What one datum of a ``forward_backward`` batch must be, checked before the request queues (a
clear 400 naming the field now beats a failed future later). Pure: numpy in, tensors out."""

from __future__ import annotations

import numpy as np
import torch

from hosted_tinker.core.custom_loss import CustomLossDef
from hosted_tinker.core.errors import bad_request
from hosted_tinker.core.losses import LossSpec
from hosted_tinker.core.types import Capabilities, DatumInput
from hosted_tinker.server.protocol.proto_codec import WireDatum
from hosted_tinker.server.serving.custom_losses import datum_inputs


def check_datum(
    d: WireDatum, index: int, caps: Capabilities, spec: LossSpec | None, custom: CustomLossDef | None = None
) -> DatumInput:
    """Datum ``index`` of a batch, checked for ``spec``'s inputs (or a custom loss's declared
    ones) and what the backend can take (``caps``): its tensors, or a 400 naming the field."""
    where = f"data[{index}]"
    n = len(d.tokens)
    if n == 0:
        raise bad_request(f"{where}.model_input is empty")
    if n > caps.max_seq_len:
        raise bad_request(f"{where}.model_input has {n} tokens, over the maximum of {caps.max_seq_len}")
    check_token_ids(d.tokens, caps.vocab_size, f"{where}.model_input")
    inputs = dict(d.loss_fn_inputs)
    targets = inputs.pop("target_tokens", None)
    if targets is None:
        raise bad_request(f"{where}.loss_fn_inputs.target_tokens is required")
    if targets.dtype.kind not in "iu":
        raise bad_request(f"{where}.loss_fn_inputs.target_tokens must be int64, got {targets.dtype}")
    topk_allowed = custom is not None or (spec is not None and spec.allows_topk_targets)
    if targets.ndim == 2 and not (topk_allowed and caps.topk_targets):
        raise bad_request(f"{where}.loss_fn_inputs.target_tokens: (N, K) targets are only valid for cross_entropy")
    if targets.shape[:1] != (n,) or targets.ndim > 2:
        raise bad_request(
            f"{where}.loss_fn_inputs.target_tokens has shape {list(targets.shape)}; expected [{n}] "
            f"(or [{n}, K]) to match model_input length {n}"
        )
    check_token_ids(targets, caps.vocab_size, f"{where}.loss_fn_inputs.target_tokens")
    if custom is not None:
        return DatumInput(
            tokens=torch.from_numpy(d.tokens.astype(np.int64)),
            target_tokens=torch.from_numpy(targets.astype(np.int64)),
            inputs=datum_inputs(custom, d, where, targets),
            images=tuple(d.images),
        )
    if spec is None:  # neither a built-in loss nor a custom one: the loss_fn check comes first
        raise bad_request(f"{where}: no loss to check it for")
    tensors: dict[str, torch.Tensor] = {}
    for key in spec.required_inputs:
        if key not in inputs:
            raise bad_request(f"{where}.loss_fn_inputs.{key} is required by this loss")
    for key, value in inputs.items():
        if key not in spec.required_inputs and key not in spec.optional_inputs:
            accepted = ["target_tokens", *spec.required_inputs, *spec.optional_inputs]
            raise bad_request(f"{where}.loss_fn_inputs.{key} is not an input of this loss; accepted: {accepted}")
        if value.dtype.kind != "f":
            raise bad_request(f"{where}.loss_fn_inputs.{key} must be float32, got {value.dtype}")
        # weights follow the target's shape ((N, K) for top-K targets); the rest are per position.
        expected = targets.shape if key == "weights" else (n,)
        if value.shape != expected:
            raise bad_request(f"{where}.loss_fn_inputs.{key} has shape {list(value.shape)}; expected {list(expected)}")
        if not np.isfinite(value).all():
            raise bad_request(f"{where}.loss_fn_inputs.{key} contains NaN or infinity")
        tensors[key] = torch.from_numpy(value.astype(np.float32))
    for key, default in spec.input_defaults.items():
        if key not in tensors:  # weights follow the target's shape, as above
            tensors[key] = torch.full(targets.shape if key == "weights" else (n,), default, dtype=torch.float32)
    return DatumInput(
        tokens=torch.from_numpy(d.tokens.astype(np.int64)),
        target_tokens=torch.from_numpy(targets.astype(np.int64)),
        inputs=tensors,
        images=tuple(d.images),
    )


def check_token_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise bad_request(f"{where} contains token id {bad}, outside the vocabulary [0, {vocab_size})")
