"""The optimizer a model is created with and each step's hyperparameters: the SDK's wire forms
checked and turned into ``core.types`` (every refusal a 400 naming the field).

A model's family is fixed at creation (``optimizer_config``) and kept by full-state resume;
each ``optim_step`` must send that family's parameters: ``adam_params`` for AdamW,
``optimizer_params`` of ``type: "dimuon"`` for Dimuon.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import ValidationError

from hosted_tinker.core.errors import bad_request
from hosted_tinker.core.types import OPTIMIZER_CONFIGS, AdamParams, DimuonParams, OptimParams
from hosted_tinker.server.protocol import json_types as wire


def family(config: wire.OptimizerConfig, field: str = "optimizer_config") -> str:
    """The family an ``optimizer_config`` selects, once it is exactly one we implement."""
    if config.type not in OPTIMIZER_CONFIGS:
        raise bad_request(
            f"{field}.type {config.type!r} is not an optimizer here; this server implements "
            f"{', '.join(map(repr, OPTIMIZER_CONFIGS))}"
        )
    given = config.model_dump()
    expected = OPTIMIZER_CONFIGS[config.type]
    for key, value in given.items():
        if key not in expected:
            raise bad_request(f"{field}.{key} is not a field of the {config.type} optimizer config")
        if value != expected[key]:
            raise bad_request(f"{field}.{key} = {value!r} is not supported; this server implements {expected[key]!r}")
    return config.type


def step_params(req: wire.OptimStepRequest, model_family: str, model_id: str) -> OptimParams:
    """The step's hyperparameters, of the model's own family."""
    if req.adam_params is not None and req.optimizer_params is not None:
        raise bad_request("send either adam_params or optimizer_params, not both")
    sent = "adamw" if req.optimizer_params is None else req.optimizer_params.get("type")
    if sent not in OPTIMIZER_CONFIGS:
        raise bad_request(
            f"optimizer_params.type {sent!r} is not an optimizer here; this server implements "
            f"{', '.join(map(repr, OPTIMIZER_CONFIGS))}"
        )
    if sent != model_family:
        wanted = "AdamParams (adam_params)" if model_family == "adamw" else f"{model_family} optimizer_params"
        raise bad_request(
            f"model {model_id} was created with the {model_family} optimizer; this optim_step sent {sent} "
            f"parameters; send {wanted}"
        )
    if model_family == "dimuon":
        return _dimuon(req.optimizer_params or {})
    return _adam(req.adam_params or wire.AdamParams())


def _adam(p: wire.AdamParams) -> AdamParams:
    _check(
        "adam_params",
        p,
        {
            "learning_rate": lambda v: v >= 0,
            "beta1": lambda v: 0 <= v < 1,
            "beta2": lambda v: 0 <= v < 1,
            "eps": lambda v: v > 0,
            "weight_decay": lambda v: v >= 0,
            "grad_clip_norm": lambda v: v >= 0,
        },
    )
    return AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)


def _dimuon(raw: dict) -> DimuonParams:
    try:
        p = wire.DimuonParams.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise bad_request(f"optimizer_params.{where}: {err['msg']}") from None
    _check(
        "optimizer_params",
        p,
        {
            "learning_rate": lambda v: v >= 0,
            "grad_clip_norm": lambda v: True,  # nonpositive: no clipping (as documented)
            "beta1": lambda v: 0 <= v < 1,
            "damping": lambda v: v > 0,
            # The learning rate is scaled by (32 / rank) ** e: beyond +-8 it over- or underflows.
            "rank_lr_correction_exponent": lambda v: abs(v) <= 8,
        },
    )
    return DimuonParams(p.learning_rate, p.grad_clip_norm, p.beta1, p.damping, p.rank_lr_correction_exponent)


def _check(field: str, params: object, in_range: dict[str, Callable[[float], bool]]) -> None:
    """Range checks here rather than in the wire type, so that a bad value uses up its seq_id."""
    for name, ok in in_range.items():
        value = getattr(params, name)
        if not math.isfinite(value) or not ok(value):
            raise bad_request(f"{field}.{name} = {value} is out of range")
