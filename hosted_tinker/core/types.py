"""What the server and the ranks say to each other about training: typed payloads.

The training calls are ``rank.trainer.Trainer``'s (which the server makes through
``core.calls.calls_to``). They run in worker processes, from one thread, one at a time. Each
either returns or raises a ``core.errors`` type (``UserError``: the caller's mistake, reported
with ``category: user``; anything else is ours, ``category: server``). A failed call leaves the
trainer's state as it was before the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hosted_tinker.core.errors import RolledBack, ServerError, UserError, WorkerError
from hosted_tinker.core.images import ImageInput

if TYPE_CHECKING:  # annotations only: the CLI (``keys``, ``--help``) need not load torch
    import numpy as np
    import torch

    from hosted_tinker.core.custom_loss import CustomLossDef
    from hosted_tinker.core.routing import Routed

# The optimizer families a model can be created with, as the SDK's ``optimizer_config`` names
# them (and as get_info / weights_info report them).
OPTIMIZER_CONFIGS: dict[str, dict] = {"adamw": {"type": "adamw"}, "dimuon": {"type": "dimuon", "version": 1}}
OPTIMIZERS = tuple(OPTIMIZER_CONFIGS)


@dataclass(frozen=True)
class LoraSpec:
    """What a training model is made of, fixed at its creation: the adapter's shape and seed,
    and its optimizer family (``OPTIMIZERS``; checkpoints from before it existed are AdamW)."""

    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    optimizer: str = "adamw"


@dataclass
class DatumInput:
    """One sequence of a forward_backward batch.

    tokens         int64 ``(N,)``: the model input
    target_tokens  int64 ``(N,)`` or ``(N, K)``: position i predicts ``target_tokens[i]``
    inputs         the other ``loss_fn_inputs``, float32, leading dim ``N``
    """

    tokens: torch.Tensor
    target_tokens: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # its images, each over a run of the model's image token in ``tokens`` (``core.images``)
    images: tuple[ImageInput, ...] = ()
    # routing replay (``rank.routing_replay``): int16 ``(N, layers, top_k)``, the experts the
    # sampler chose for each input position in each mixture-of-experts layer, -1 where it
    # recorded none (there the learner's router chooses)
    routing: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class ForwardBackwardBatch:
    data: list[DatumInput]
    loss_fn: str
    loss_config: Mapping[str, float]
    forward_only: bool
    custom_loss: CustomLossDef | None = None  # loss_fn "custom": the session's stored loss
    # its data name sequences the sampler recorded (provenance): on a mixture-of-experts model the
    # response says how much of their routing was replayed (``core.routing.replay_metrics``)
    recorded: bool = False


@dataclass
class ForwardBackwardResult:
    """Per datum: learner log-probs (float32 ``(N,)`` or ``(N, K)``) and the loss's per-token
    terms (same shape, ``elementwise_loss``; None for a custom loss, which has no per-token
    terms); the summed loss, and a custom loss's metrics summed over the datums."""

    logprobs: list[np.ndarray]
    loss_sum: float
    elementwise_loss: list[np.ndarray | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    # a mixture-of-experts model's routing over the request's tokens (``core.routing``); None for a dense model
    routed: Routed | None = None


@dataclass(frozen=True)
class RequestFailed:
    """One request of a joint ``forward_backward_many`` that failed where the others did not:
    how a rank reports a failed call (``core.messages``: "user_error", "peer_failed", "error"),
    or "rolled_back": the server ran it nowhere, its model being owed a ``RolledBack`` notice
    (``server.workers.backend``); and its message."""

    kind: str
    message: str

    def error(self) -> ServerError:
        """The exception the request's call alone would have raised."""
        if self.kind == "user_error":
            return UserError(self.message)
        if self.kind == "rolled_back":
            return RolledBack.said(self.message)
        return WorkerError(self.message)


@dataclass
class AdapterState:
    """Everything needed to continue training a model exactly where it stopped.

    weights    LoRA tensors under PEFT's key names (``...q_proj.lora_A.weight``), on CPU
    optimizer  the optimizer's state per weight key, of the family ``lora.optimizer`` names:
               AdamW's ``<key>.exp_avg``, ``<key>.exp_avg_sq``, ``<key>.step``; Dimuon's
               ``<key>.momentum``
    steps      optimizer steps taken
    rng_state  the model's own torch generator state (uint8)
    gradients  per weight key, the gradients of forward_backward calls no optim_step has applied
               yet, summed over the ranks (a parked model's; a checkpoint has none)
    """

    lora: LoraSpec
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    steps: int
    rng_state: torch.Tensor
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 means no clipping


@dataclass(frozen=True)
class DimuonParams:
    """One Dimuon step's hyperparameters (``core.dimuon`` says what each does)."""

    learning_rate: float
    grad_clip_norm: float = 0.0  # 0 means no clipping
    beta1: float = 0.9
    damping: float = 0.1
    rank_lr_correction_exponent: float = 0.5


OptimParams = AdamParams | DimuonParams


def optimizer_family(params: OptimParams) -> str:
    return "dimuon" if isinstance(params, DimuonParams) else "adamw"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; shown in ``/healthz`` and checked before work is queued."""

    backend: str
    arch: str  # the base model's architecture class, e.g. Qwen3ForCausalLM
    losses: tuple[str, ...]
    max_seq_len: int
    max_tokens_per_batch: int
    vocab_size: int
    topk_targets: bool = True
    sampling: bool = False
    devices: tuple[str, ...] = ()  # where it trains: one device per rank
    replicas: int = 1  # data-parallel replicas: how many shards a forward_backward batch is split into
    optimizers: tuple[str, ...] = OPTIMIZERS
    # how it trains, as the ranks resolved it: the base's dtype, that of LoRA's products
    # (float32 or the base's), and the rule of activation memory (GiB, "auto", or None: the
    # backend option recompute_above_tokens)
    dtype: str = "float32"
    lora_compute: str = "float32"
    activation_memory_gib: float | str | None = None
    family: str = ""  # its config's model_type, e.g. qwen3_5_moe
    # routed experts per mixture-of-experts layer (0: a dense model); train_mlp puts a LoRA on each
    routed_experts: int = 0
    # routing replay (``rank.routing_replay``): (MoE layers, experts per token) of each token's
    # recorded routing; (0, 0) where nothing is recorded or replayed (a dense model)
    replay_routing: tuple[int, int] = (0, 0)
    # the decoder layers with routed experts, first to last: which layers a recorded routing's are
    moe_layers: tuple[int, ...] = ()
    # Gated-DeltaNet (linear attention) layers, trained over packed sequences (0: none)
    linear_attention_layers: int = 0
    images: bool = False  # whether a ModelInput may hold images (ImageChunk) for this model
    image_token_id: int = -1  # the token an image's positions hold (images only)
    # which of train_attn / train_mlp / train_unembed find layers to train on this model
    lora_groups: tuple[str, ...] = ("attn", "mlp", "unembed")
    # per LoRA flag, the parameters its layers' LoRA adds per unit of rank (the whole model's,
    # unsharded; the cookbook's ``hyperparam_utils`` table measures the service's the same way)
    lora_params_per_rank: dict[str, int] = field(default_factory=dict)


# What a trainable parameter holds on a rank besides itself (float32, 4 bytes): its gradient,
# and its optimizer's state (AdamW: two moments; Dimuon: one momentum).
_STATE_BYTES = {"adamw": 4 + 8, "dimuon": 4 + 4}


def adapter_bytes(lora: LoraSpec, per_rank: Mapping[str, int]) -> int:
    """The worker memory a LoRA of ``lora``'s shape takes while trained: its float32 weights,
    their gradients and the optimizer's state (``per_rank``: ``Capabilities.lora_params_per_rank``)."""
    return lora_params(lora, per_rank) * (4 + _STATE_BYTES[lora.optimizer])


def lora_params(lora: LoraSpec, per_rank: Mapping[str, int]) -> int:
    """How many numbers a LoRA of ``lora``'s shape holds (an export's float32 tensors: 4 bytes each)."""
    groups = {"attn": lora.train_attn, "mlp": lora.train_mlp, "unembed": lora.train_unembed}
    return lora.rank * sum(count for group, count in per_rank.items() if groups.get(group))
