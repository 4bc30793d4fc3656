"""Checkpoints are interchangeable between the megatron (tp=2) and peft backends (issue #16): a
training state written by one, as files, loads on the other, and the next steps agree (log-probs,
``loss:sum``, ``grad_norm``) to 1e-4; the adapter config each writes is the same PEFT config; and
the sampler weights megatron exports load into PEFT itself. The same for a mixture-of-experts
model whose experts megatron splits over two ranks (``ep=2``, issue #42), for DeepSeek-V3
(latent attention with YaRN, a dense first layer, shared experts) and gpt-oss (sinks, windows,
biased experts), both on ``tp=2 ep=2``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hosted_tinker.core.checkpoints import TinkerPath, peft_adapter_files, state_from_files, state_to_files
from hosted_tinker.core.config import ServerConfig
from hosted_tinker.core.types import DatumInput, DimuonParams, ForwardBackwardBatch, LoraSpec
from hosted_tinker.rank.serve import local_rank
from hosted_tinker.rank.trainer import Trainer
from hosted_tinker.server.workers.backend import ProcessBackend
from hosted_tinker.server.workers.launch import rank_factories
from tests.support.batches import random_batch
from tests.support.megatron import ADAM, LORA, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-4


@pytest.fixture(scope="module")
def megatron(tiny_model_dir: Path):
    config = ServerConfig(
        model=str(tiny_model_dir), backend="megatron", train_devices="cpu:2", backend_options={"tp": "2"}
    )
    backend = ProcessBackend(rank_factories(config, str(tiny_model_dir)))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def peft(tiny_model_dir: Path) -> Trainer:
    return local_rank(str(tiny_model_dir)).trainer


@pytest.fixture(scope="module")
def moe(tiny_family) -> Iterator[tuple[ProcessBackend, Trainer]]:
    """megatron with the tiny Qwen3-MoE's experts split over two ranks, and peft on the same model."""
    model = str(tiny_family("qwen3_moe"))
    config = ServerConfig(model=model, backend="megatron", train_devices="cpu:2", backend_options={"ep": "2"})
    backend = ProcessBackend(rank_factories(config, model))
    yield backend, local_rank(model).trainer
    backend.close()


@pytest.fixture(scope="module")
def deepseek(tiny_family, tmp_path_factory) -> Iterator[tuple[ProcessBackend, Trainer]]:
    """megatron on the tiny DeepSeek-V3 with DeepSeek-V3's YaRN (its factor of 40 over a short
    original context, so that the frequency ramp and both mscale factors bite) and an
    ``rms_norm_eps`` its latent norms do not take (HF gives them 1e-6), its attention split over
    two ranks and its experts too; and peft on the same model."""
    model = tmp_path_factory.mktemp("deepseek") / "yarn"
    shutil.copytree(tiny_family("deepseek_v3"), model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=16,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    config["rms_norm_eps"] = 1e-2
    (model / "config.json").write_text(json.dumps(config))
    options = {"tp": "2", "ep": "2", "sequence_parallel": "true"}
    server = ServerConfig(model=str(model), backend="megatron", train_devices="cpu:2", backend_options=options)
    backend = ProcessBackend(rank_factories(server, str(model)))
    yield backend, local_rank(str(model)).trainer
    backend.close()


@pytest.fixture(scope="module")
def qwen3_5(tiny_family, tmp_path_factory) -> Iterator[tuple[ProcessBackend, Trainer]]:
    """megatron on the tiny Qwen3.5-MoE (Gated-DeltaNet and output-gated attention layers,
    zero-centred norms, a partial rotary embedding, a gated shared expert), its linear attention's
    heads split over two ranks and its experts too; and peft on the same model. Its experts are
    written as the released checkpoints keep them, fused in 3-D tensors (transformers' own save
    writes them one by one)."""
    from safetensors.torch import save_file

    model = tmp_path_factory.mktemp("qwen3_5") / "fused"
    shutil.copytree(tiny_family("qwen3_5_moe"), model)
    weights = load_file(model / "model.safetensors")
    for layer in range(2):
        experts = f"model.language_model.layers.{layer}.mlp.experts"
        each = [f"{experts}.{e}" for e in range(8)]
        weights[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([weights.pop(f"{x}.gate_proj.weight"), weights.pop(f"{x}.up_proj.weight")]) for x in each]
        )
        weights[f"{experts}.down_proj"] = torch.stack([weights.pop(f"{x}.down_proj.weight") for x in each])
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    model = str(model)
    options = {"tp": "2", "ep": "2", "sequence_parallel": "true"}
    config = ServerConfig(model=model, backend="megatron", train_devices="cpu:2", backend_options=options)
    backend = ProcessBackend(rank_factories(config, model))
    yield backend, local_rank(model).trainer
    backend.close()


@pytest.fixture(scope="module")
def gpt_oss(tiny_family) -> Iterator[tuple[ProcessBackend, Trainer]]:
    """megatron on the tiny gpt-oss (sinks, sliding windows, YaRN, biases, fused interleaved
    experts) with its attention split over two ranks (its sinks with its heads) and its experts
    too; and peft on the same model."""
    model = str(tiny_family("gpt_oss"))
    options = {"tp": "2", "ep": "2", "sequence_parallel": "true"}
    config = ServerConfig(model=model, backend="megatron", train_devices="cpu:2", backend_options=options)
    backend = ProcessBackend(rank_factories(config, model))
    yield backend, local_rank(model).trainer
    backend.close()


def through_files(state, config: dict):
    """A training state as the server writes it to disk and reads it back."""
    path = TinkerPath("m", "weights", "x")
    return state_from_files(path, state_to_files(state, config, "tiny")).state


def assert_agree(got: list, want: list) -> None:
    for (lp_g, loss_g, norm_g), (lp_w, loss_w, norm_w) in zip(got, want, strict=True):
        for g, w in zip(lp_g, lp_w, strict=True):
            np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)
        assert loss_g == pytest.approx(loss_w, rel=TOL, abs=TOL)
        assert norm_g == pytest.approx(norm_w, rel=TOL)


@pytest.mark.parametrize("direction", ["megatron->peft", "peft->megatron"])
def test_a_training_state_moves_between_backends(direction: str, megatron: ProcessBackend, peft: Trainer):
    moves_between(direction, megatron, peft)


@pytest.mark.parametrize("model", ["moe", "deepseek", "gpt_oss", "qwen3_5"])
@pytest.mark.parametrize("direction", ["megatron->peft", "peft->megatron"])
def test_a_mixture_of_experts_state_moves_between_backends(direction: str, model: str, request):
    moves_between(direction, *request.getfixturevalue(model))


@pytest.mark.parametrize("model", ["moe", "deepseek", "gpt_oss", "qwen3_5"])
def test_the_same_seed_starts_the_experts_at_the_same_weights(model: str, request):
    megatron, peft = request.getfixturevalue(model)
    for backend in (megatron.trainer, peft):
        backend.create_adapter("seeded", LORA)
    got, want = megatron.trainer.export_state("seeded"), peft.export_state("seeded")
    assert list(got.weights) == list(want.weights)
    assert any(".experts.w2.lora_A." in k for k in want.weights)
    if model == "deepseek":  # every projection of its latent attention, its dense MLP and shared experts
        assert {k.split(".")[-3] for k in want.weights} >= {"kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"}
        assert any(".shared_experts.down_proj." in k for k in want.weights)
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    assert megatron.capabilities.routed_experts == 8
    # what the quotas size an adapter by: all experts', though each rank holds half of them
    assert megatron.capabilities.lora_params_per_rank == peft.model.lora_params_per_rank
    assert sum(v.numel() for v in got.weights.values()) == LORA.rank * sum(peft.model.lora_params_per_rank.values())
    for backend in (megatron.trainer, peft):
        backend.delete_adapter("seeded")


def test_tokens_that_miss_a_ranks_experts_step_as_on_peft(moe: tuple[ProcessBackend, Trainer], tiny_family):
    """A datum whose tokens all go to rank 0's experts (0-3) in some layer: rank 1's slices of the
    experts' own factors get no gradient from it. They get a zero one, as on peft (whose 3-D
    tensor has one gradient), so both ranks export and step the same tensors: the gradients
    exported mid-accumulation, a Dimuon step (which gathers whole matrices over the ranks) and
    the weights after it are peft's."""
    megatron, peft = moe
    tokens = rank0_only_tokens(tiny_family("qwen3_moe"))
    datum = DatumInput(torch.tensor(tokens[:-1]), torch.tensor(tokens[1:]), {"weights": torch.ones(len(tokens) - 1)})
    batch = ForwardBackwardBatch([datum], "cross_entropy", {}, False)
    spec = LoraSpec(rank=4, seed=7, optimizer="dimuon")
    for backend in (megatron.trainer, peft):
        backend.create_adapter("missed", spec)
        backend.forward_backward("missed", batch)
    got, want = (
        megatron.trainer.export_state("missed", with_gradients=True),
        peft.export_state("missed", with_gradients=True),
    )
    assert got.gradients.keys() == want.gradients.keys()
    for key, grad in want.gradients.items():
        np.testing.assert_allclose(got.gradients[key], grad, rtol=TOL, atol=TOL, err_msg=key)
    params = DimuonParams(learning_rate=0.02, grad_clip_norm=3.0, beta1=0.8, damping=0.05)
    assert megatron.trainer.optim_step("missed", params)["grad_norm"] == pytest.approx(
        peft.optim_step("missed", params)["grad_norm"], rel=TOL
    )
    got, want = megatron.trainer.export_state("missed"), peft.export_state("missed")
    for key, tensor in want.weights.items():
        np.testing.assert_allclose(got.weights[key], tensor, rtol=1e-3, atol=1e-5, err_msg=key)
    for backend in (megatron.trainer, peft):
        backend.delete_adapter("missed")


def test_a_replayed_routing_trains_as_on_peft(moe: tuple[ProcessBackend, Trainer]):
    """Routing replay on megatron's router (``rank.mcore.experts._Replayer``): two datums of
    forced experts (the first positions left to the router), one on each expert-parallel rank,
    give peft's log-probs, loss, gradients and replay counts."""
    megatron, peft = moe
    layers, top_k = megatron.capabilities.replay_routing
    assert (layers, top_k) == peft.model.replay_routing == (2, 2)
    assert megatron.capabilities.moe_layers == peft.model.moe_layers == (0, 1)
    g = torch.Generator().manual_seed(5)
    data = []
    for n in (11, 6):
        tokens = torch.randint(10, 500, (n + 1,), generator=g)
        forced = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(n * layers)])
        forced = forced.view(n, layers, top_k).to(torch.int16)
        forced[:2] = -1
        data.append(DatumInput(tokens[:-1], tokens[1:], {"weights": torch.ones(n)}, routing=forced))
    batch = ForwardBackwardBatch(data, "cross_entropy", {}, False)
    results = []
    for backend in (megatron.trainer, peft):
        backend.create_adapter("replayed", LoraSpec(rank=4, seed=3))
        results.append(backend.forward_backward("replayed", batch))
    got, want = results
    for g_lp, w_lp in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(g_lp, w_lp, rtol=TOL, atol=TOL)
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=TOL)
    assert (got.routed.replayed, got.routed.routings) == (want.routed.replayed, want.routed.routings) == (26, 34)
    assert got.routed.changed == want.routed.changed > 0
    np.testing.assert_array_equal(got.routed.counts, want.routed.counts)
    got_g = megatron.trainer.export_state("replayed", with_gradients=True).gradients
    want_g = peft.export_state("replayed", with_gradients=True).gradients
    for key, grad in want_g.items():
        np.testing.assert_allclose(got_g[key], grad, rtol=TOL, atol=TOL, err_msg=key)
    for backend in (megatron.trainer, peft):
        backend.delete_adapter("replayed")


def rank0_only_tokens(model: Path) -> list[int]:
    """Three tokens whose two positions route only to experts 0-3 in layer 0 of ``model``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    routed: list[torch.Tensor] = []
    experts = hf.model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, args: routed.append(args[1]))
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = [int(t) for t in rng.integers(10, 500, 3)]
        routed.clear()
        with torch.no_grad():
            hf(input_ids=torch.tensor([tokens[:-1]]))
        if int(routed[0].max()) < 4:
            return tokens
    raise AssertionError("no such tokens among 2000 draws")


def moves_between(direction: str, megatron: ProcessBackend, peft: Trainer) -> None:
    """A state written by one backend, as files, loads on the other; the next steps agree."""
    source, target = (megatron.trainer, peft) if direction == "megatron->peft" else (peft, megatron.trainer)
    name = direction.replace("->", "-to-")
    source.create_adapter(name, LORA)
    steps(source, name, seed=1, n=2)
    config = source.peft_config(name)
    saved = through_files(source.export_state(name), config)
    target.create_adapter(name, LoraSpec(rank=4, seed=99, train_unembed=True))  # other weights, then the state
    target.load_state(name, saved, with_optimizer=True)
    assert target.peft_config(name) == config
    assert_agree(steps(target, name, seed=2, n=3), steps(source, name, seed=2, n=3))
    for backend in (source, target):
        backend.delete_adapter(name)


def test_the_same_seed_starts_at_the_same_weights(megatron: ProcessBackend, peft: Trainer):
    """LoRA is drawn as PEFT draws it, so a seed starts a model where peft starts it."""
    for backend in (megatron.trainer, peft):
        backend.create_adapter("seeded", LORA)
    got, want = megatron.trainer.export_state("seeded"), peft.export_state("seeded")
    assert list(got.weights) == list(want.weights)
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    # what the server sizes a key's adapters by (``server.quotas``' adapter_bytes): the parameters
    # made, every group of the model being on in LORA
    per_rank = megatron.capabilities.lora_params_per_rank
    assert sum(v.numel() for v in got.weights.values()) == LORA.rank * sum(per_rank.values())
    for backend in (megatron.trainer, peft):
        backend.delete_adapter("seeded")


def test_sampler_weights_load_into_peft(megatron: ProcessBackend, tiny_model_dir: Path, tmp_path: Path):
    """megatron's exported adapter is a PEFT folder: PEFT loads it onto the HF model, and its
    log-probs are the trainer's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    megatron.trainer.create_adapter("export", LORA)
    steps(megatron.trainer, "export", seed=3, n=2)
    files = peft_adapter_files(megatron.trainer.peft_config("export"), megatron.trainer.export_state("export").weights)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path).eval()
    batch = random_batch(np.random.default_rng(4), 2, "cross_entropy")
    trainer = megatron.trainer.forward_backward("export", dataclasses.replace(batch, forward_only=True))
    for datum, lp in zip(batch.data, trainer.logprobs, strict=True):
        with torch.no_grad():
            logits = hf(datum.tokens[None]).logits[0].log_softmax(-1)
        want = logits.gather(-1, datum.target_tokens[:, None])[:, 0]
        np.testing.assert_allclose(lp, want.numpy(), rtol=TOL, atol=TOL)
    megatron.trainer.delete_adapter("export")


def topk_batch(rng: np.random.Generator) -> ForwardBackwardBatch:
    """Cross-entropy against K=4 soft targets per position (distillation), unequal lengths."""
    data = []
    for n in (5, 11, 3):
        tokens = torch.from_numpy(rng.integers(10, 500, n))
        targets = torch.from_numpy(rng.integers(0, 512, (n, 4)))
        weights = torch.from_numpy(rng.dirichlet(np.ones(4), n).astype(np.float32))
        data.append(DatumInput(tokens=tokens, target_tokens=targets, inputs={"weights": weights}))
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def test_top_k_targets(megatron: ProcessBackend, peft: Trainer):
    """(N, K) targets, scored vocab-parallel, as peft scores them."""
    for backend in (megatron.trainer, peft):
        backend.create_adapter("topk", LORA)
    batch = topk_batch(np.random.default_rng(6))
    got, want = megatron.trainer.forward_backward("topk", batch), peft.forward_backward("topk", batch)
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert g.shape == w.shape and g.shape[1] == 4
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=TOL)
    assert megatron.trainer.optim_step("topk", ADAM)["grad_norm"] == pytest.approx(
        peft.optim_step("topk", ADAM)["grad_norm"], rel=TOL
    )
    for backend in (megatron.trainer, peft):
        backend.delete_adapter("topk")


def other_architecture(arch: str):
    """An untied Llama (its own vocab-parallel output layer, LoRA on lm_head, no q/k norms), or
    a Qwen2 (q/k/v biases, sharded with their rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 5e5,
    }
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    with torch.no_grad():
        for module in model.modules():  # HF starts biases at zero, which would check nothing
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_5"])
def test_other_architectures_at_tp_2(arch: str, tmp_path: Path, tiny_model_dir: Path, tiny_family):
    """And the dense Qwen3.5 (tied, as Qwen3.5-4B): Gated-DeltaNet layers split by heads, gated
    full attention, partial rotary, (1 + w) norms."""
    if arch == "qwen3_5":
        tmp_path = tiny_family("qwen3_5")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            other_architecture(arch).save_pretrained(tmp_path)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the embedded sampler's, for stop strings
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    layout = ServerConfig(model=str(tmp_path), backend="megatron", train_devices="cpu:2", backend_options={"tp": "2"})
    megatron = ProcessBackend(rank_factories(layout, str(tmp_path)))
    peft = local_rank(str(tmp_path)).trainer
    try:
        lora = LoraSpec(rank=4, seed=2, train_unembed=True)
        for backend in (megatron.trainer, peft):
            backend.create_adapter(arch, lora)
        assert any("lm_head" in key for key in megatron.trainer.export_state(arch).weights)
        if arch == "qwen2":
            assert any(k.endswith("q_proj.bias") for k in load_file(tmp_path / "model.safetensors"))
        rng = np.random.default_rng(8)
        for loss_fn in ("cross_entropy", "ppo"):
            batch = random_batch(rng, 3, loss_fn, vocab=256)
            got, want = megatron.trainer.forward_backward(arch, batch), peft.forward_backward(arch, batch)
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)
            assert megatron.trainer.optim_step(arch, ADAM)["grad_norm"] == pytest.approx(
                peft.optim_step(arch, ADAM)["grad_norm"], rel=TOL
            )
        if arch == "qwen3_5":  # the family's state, both ways (the others': the MoE and Qwen3 tests)
            moves_between("megatron->peft", megatron, peft)
            moves_between("peft->megatron", megatron, peft)
    finally:
        megatron.close()


@pytest.mark.parametrize("lora_compute", ["float32", "base"])
def test_a_bfloat16_base_trains_float32_lora(tiny_model_dir: Path, lora_compute: str):
    """``--dtype bfloat16``: the base model in bf16, the LoRA weights, their AdamW moments and
    the reduced gradients in fp32, whether LoRA's products are float32 or bf16 (``--lora-compute
    base``); the first step is peft's bf16 one up to bf16's rounding."""
    config = ServerConfig(
        model=str(tiny_model_dir),
        backend="megatron",
        train_devices="cpu:2",
        backend_options={"tp": "2"},
        dtype="bfloat16",
        lora_compute=lora_compute,
    )
    backend = ProcessBackend(rank_factories(config, str(tiny_model_dir)))
    peft = local_rank(str(tiny_model_dir), dtype="bfloat16", lora_compute=lora_compute).trainer
    try:
        got, want = [], []
        for trainer, out in ((backend.trainer, got), (peft, want)):
            trainer.create_adapter("bf16", LORA)
            out += steps(trainer, "bf16", seed=2, n=1)
        (lp_g, loss_g, norm_g), (lp_w, loss_w, norm_w) = got[0], want[0]
        assert loss_g == pytest.approx(loss_w, rel=2e-3)
        assert norm_g == pytest.approx(norm_w, rel=2e-3)
        for g, w in zip(lp_g, lp_w, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, atol=5e-2)
        state = backend.trainer.export_state("bf16")
        assert {t.dtype for t in [*state.weights.values(), *state.optimizer.values()]} == {torch.float32}
    finally:
        backend.close()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="transformer-engine layers run on CUDA only (the CPU runs the local spec, checked above)",
)
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine not installed")
def test_transformer_engine_layers_train_as_the_local_ones(tiny_model_dir: Path):
    """The seam behind ``layers``: the same steps on TE's layers and on megatron-core's PyTorch
    ones (the CPU twin every other test here runs) agree, LoRA hooks included, on a bfloat16 base
    (where ``auto`` picks TE: its fused and flash attention take 16-bit inputs only)."""
    results = {}
    for layers in ("te", "local"):
        config = ServerConfig(
            model=str(tiny_model_dir),
            backend="megatron",
            train_devices="cuda:0",
            backend_options={"layers": layers},
            dtype="bfloat16",
        )
        backend = ProcessBackend(rank_factories(config, str(tiny_model_dir)))
        try:
            backend.trainer.create_adapter("m", LORA)
            results[layers] = steps(backend.trainer, "m", seed=3, n=2)
        finally:
            backend.close()
    for (lp_te, loss_te, norm_te), (lp, loss, norm) in zip(results["te"], results["local"], strict=True):
        for a, b in zip(lp_te, lp, strict=True):
            np.testing.assert_allclose(a, b, atol=5e-2)  # bf16 kernels that sum in other orders
        assert loss_te == pytest.approx(loss, rel=1e-2)
        assert norm_te == pytest.approx(norm, rel=1e-2)


def test_a_cpu_rank_on_a_machine_with_a_gpu_keeps_megatron_on_the_cpu() -> None:
    """A CPU rank where ``torch.cuda.is_available()`` (e.g. the CPU checks on a GPU machine): its
    rotary frequencies stay on the CPU (megatron-core moves them to ``torch.cuda.current_device()``
    at the first forward), instead of a device mismatch in the rank's first step."""
    script = """
import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as megatron-core can tell
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from hosted_tinker.rank.mcore import cpu
cpu.use_cpu()
print(RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(4).device)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["cpu"], out.stderr[-2000:]
