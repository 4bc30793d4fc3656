"""megatron-core on CPU ranks (gloo): its tensor-parallel RNG tracker and rotary embedding call
``torch.cuda`` unconditionally. On a CPU rank those calls are pointed at the CPU generator and
device; a CUDA rank is left untouched. (gpu-and-engines.md §2: with exactly these, TP=2 on gloo
trains like TP=1.) torch.compile is off on a CPU rank. A CPU rank is patched also on a machine
with a GPU: megatron would otherwise move its rotary frequencies to ``cuda:0`` under a CPU model,
and seed a CUDA context there."""

from __future__ import annotations

import torch

_patched = False


def use_cpu() -> None:
    """Point megatron-core's CUDA RNG and device calls at the CPU, once per process (a CPU rank's:
    a process runs one rank on one device)."""
    global _patched
    if _patched:
        return
    import megatron.core.tensor_parallel.random as mcore_random

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # megatron passes it on as a device
    torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    # megatron-core wraps small helpers in torch.compile (``jit_fuser``: gpt-oss's quick_gelu, the
    # router's expert-bias count, ...), which on a CPU rank means inductor compiling C++ for them
    # in every rank, for no gain. They run as written instead.
    torch._dynamo.config.disable = True
    _patched = True
