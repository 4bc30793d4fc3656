"""An independent float64 reference of LoRA on a Hugging Face model, for the rank-level tests.

The same HF model in float64 (the clean tree: transformers' own forward of every layer, one
sequence unpacked), with every adapter applied by hand: a dense layer's ``B(A x)`` in a forward
hook; Tinker's q/k/v slices of a Gated-DeltaNet layer's fused ``in_proj_qkv`` each added to its
own rows; each routed token through its own expert's ``B_e(A_e x)`` one token at a time (no
sorting, no grouping). Nothing of ``rank.adapters`` / ``rank.experts`` / ``rank.linear_attention``
is used to compute it.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import Tensor, nn

from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.model import HfLoraModel

KEY_PREFIX = "base_model.model."  # PEFT's, as checkpoints key the tensors
QKV = ("in_proj_q", "in_proj_k", "in_proj_v")  # Tinker's names of in_proj_qkv's row blocks, in order


def datum(tokens: list[int]) -> DatumInput:
    return DatumInput(
        tokens=torch.tensor(tokens[:-1]),
        target_tokens=torch.tensor(tokens[1:]),
        inputs={"weights": torch.ones(len(tokens) - 1)},
    )


def trained_looking(model: HfLoraModel, spec: LoraSpec):
    """An adapter whose B matrices are off zero (a new one changes nothing)."""
    handle = model.add_adapter(spec)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for key, p in zip(handle.keys, handle.params, strict=True):
            if ".lora_B." in key:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return handle


def assert_close_in_float32(got: Tensor, want: Tensor) -> None:
    """Equal up to float32's rounding, measured against the tensor's largest entry (gradients
    reach the first layers through sums of many terms: their small entries keep no fixed
    relative precision)."""
    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=2e-5 * float(want.abs().max()) + 1e-9)


def assert_as_close_as_float32_goes(got: Tensor, want: Tensor, want_in_float32: Tensor) -> None:
    """``got`` (float32) is as close to the float64 ``want`` as the reference itself run in float32
    comes (twice its distance at most), or as ``assert_close_in_float32`` asks: the gated delta
    rule's gradients through its L2-normalised q and k lose more digits in float32 than a
    transformer's, in transformers' own implementation as in ours."""
    own = float((want_in_float32.double() - want).abs().max())
    bound = max(2e-5 * float(want.abs().max()) + 1e-9, 2 * own)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=bound)


def reference_logprobs(
    model: HfLoraModel, weights: dict[str, Tensor], scale: float, data: DatumInput, dtype: torch.dtype = torch.float64
):
    """Target log-probs of ``data`` under ``weights`` (keyed as checkpoints key them), and their
    gradients with respect to each tensor: in ``dtype`` throughout, every update applied by hand."""
    ref = copy.deepcopy(model.shareable_base).to(dtype)  # the clean tree: no hook of ours on it
    leaves = {k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in weights.items()}
    loras: dict[str, dict[str, Tensor]] = {}
    for key, tensor in leaves.items():
        module, part = key.removeprefix(KEY_PREFIX).rsplit(".", 2)[:2]
        loras.setdefault(module, {})[part] = tensor
    for name, module in ref.named_modules():
        if name in loras and isinstance(module, nn.Linear):
            module.register_forward_hook(linear_update(loras[name], scale))
        elif name.endswith(".in_proj_qkv") and f"{name.removesuffix('_qkv')}_q" in loras:
            parent = name.removesuffix(".in_proj_qkv")
            module.register_forward_hook(qkv_update([loras[f"{parent}.{p}"] for p in QKV], scale))
        elif f"{name}.w1" in loras or f"{name}.w2" in loras:
            module.forward = types.MethodType(per_token_experts(name, loras, scale), module)
    logits = ref(input_ids=data.tokens[None]).logits[0]
    logprobs = logits.log_softmax(-1).gather(-1, data.target_tokens[:, None])[:, 0]
    grads = torch.autograd.grad(logprobs.sum(), list(leaves.values()))
    return logprobs.detach(), dict(zip(leaves, grads, strict=True))


def linear_update(lora: dict[str, Tensor], scale: float):
    return lambda m, args, out: out + scale * (args[0] @ lora["lora_A"].T @ lora["lora_B"].T)


def qkv_update(loras: list[dict[str, Tensor]], scale: float):
    """q, k and v each with its own LoRA, their updates side by side as the fused rows lie."""

    def hook(m: nn.Module, args: tuple, out: Tensor) -> Tensor:
        updates = [scale * (args[0] @ lora["lora_A"].T @ lora["lora_B"].T) for lora in loras]
        return out + torch.cat(updates, dim=-1)

    return hook


def per_token_experts(name: str, loras: dict[str, dict[str, Tensor]], scale: float):
    def update(lora: dict[str, Tensor] | None, e: int, v: Tensor) -> Tensor | int:
        if lora is None:
            return 0
        a, b = lora["lora_A"], lora["lora_B"]  # a factor of leading dimension 1 is every expert's
        return scale * (b[e if len(b) > 1 else 0] @ (a[e if len(a) > 1 else 0] @ v))

    def forward(experts: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        size = experts.intermediate_dim
        out = []
        for t in range(hidden.shape[0]):
            x, total = hidden[t], torch.zeros_like(hidden[t])
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])

                gate = experts.gate_up_proj[e][:size] @ x + update(loras.get(f"{name}.w1"), e, x)
                up = experts.gate_up_proj[e][size:] @ x + update(loras.get(f"{name}.w3"), e, x)
                h = experts.act_fn(gate) * up
                total = total + top_k_weights[t, k] * (experts.down_proj[e] @ h + update(loras.get(f"{name}.w2"), e, h))
            out.append(total)
        return torch.stack(out)

    return forward
