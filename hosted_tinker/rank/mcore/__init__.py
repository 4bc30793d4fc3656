"""The base model on megatron-core's tensor-parallel layers, with LoRA on them (the ``megatron``
plan's model). Imports megatron-core: only a rank of that plan imports this package.

- ``cpu``: megatron-core's CUDA-only RNG and device calls, pointed at the CPU (gloo ranks).
- ``convert``: a Hugging Face Qwen3 / Llama checkpoint as megatron-core's config and, per rank,
  the shards of its weights (read from the safetensors, never whole).
- ``lora``: LoRA on the tensor-parallel layers, sharded like them, keyed by PEFT's names.
- ``vocab``: per-token log-probs from vocab-parallel logits.
- ``model``: ``McoreLoraModel``, the ``LoraModel`` the trainer drives.
"""

import logging
import warnings


def quiet() -> None:
    """Before megatron-core is first imported: its notes that the optional fused kernels (Apex,
    transformer-engine) are absent and which FSDP it found are not a rank's news."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)


def without_transformer_engine() -> None:
    """Where transformer-engine is absent, two megatron-core 0.16.1 modules that assume it.

    Its MoE router reads ``te_general_gemm``, which ``moe_utils`` defines only when
    transformer-engine imports (a ``NameError`` otherwise, in every router's forward): without
    it, None, whose branch is the ``torch.mm`` the module falls back to. Its latent attention
    sets ``HAVE_TE`` when megatron's TE extension imports, which it does without
    transformer-engine too (``MagicMock`` stand-ins), then asks ``isinstance(..., TELinear)`` of a
    stand-in (a ``TypeError`` building every MLA layer): the extension's own flag is the truth."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
