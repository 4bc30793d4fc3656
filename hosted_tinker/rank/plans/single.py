"""One rank on one device: every collective is the identity, and the step is exactly PEFT's."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hosted_tinker.rank.model import HfLoraModel, SplitDim, SyntheticLoraModel
from hosted_tinker.rank.plans.options import SingleOptions as Options

DEVICES = "one: --device cpu | cuda:N"  # what `hosted-tinker backends` says of where it trains
# ... and of which models it trains (docs/compatibility.md, "models", says each family's LoRA)
MODELS = (
    "any transformers causal LM whose linear layers take LoRA, and the lineup's families: mixture of experts, "
    "hybrid linear attention, vision-language"
)


class Plan:
    rank = 0
    world_size = 1
    replicas = 1

    def __init__(self, rank: int, devices: list[str], init_method: str, options: Options) -> None:
        self.device = devices[0]
        self.synthetic = options.synthetic
        index = torch.device(self.device).index
        if self.device.startswith("cuda") and index is not None:  # cuda:N: memory statistics are its
            torch.cuda.set_device(index)

    def build_model(self, model_path: str, *, dtype: str, lora_alpha: float, lora_compute: str) -> HfLoraModel:
        model = SyntheticLoraModel if self.synthetic else HfLoraModel
        return model(model_path, device=self.device, dtype=dtype, lora_alpha=lora_alpha, lora_compute=lora_compute)

    def all_succeeded(self, succeeded: bool) -> bool:
        return succeeded

    def passes(self, count: int) -> int:
        return count

    def least(self, value: float) -> float:
        return value

    def shard_failed(self, failed: bool) -> bool:
        return failed  # a shard runs on one rank

    def broadcast_initial(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        pass

    def reduce_gradients(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        pass

    def replicas_of(self, split_dim: SplitDim) -> int:
        return 1

    def grad_norm(self, grads: list[Tensor], split_dims: list[SplitDim]) -> Tensor:
        return local_norm(grads)

    def gather(self, tensors: dict[str, tuple[Tensor, SplitDim]]) -> dict[str, Tensor] | None:
        return {key: t.detach().cpu().clone() for key, (t, _) in tensors.items()}

    def shard(self, full: Tensor, split_dim: SplitDim) -> Tensor:
        return full

    def whole(self, t: Tensor, split_dim: SplitDim) -> Tensor:
        return t


def local_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm over all of ``grads`` (norm of the per-tensor norms: one pass each)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
