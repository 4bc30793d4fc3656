"""Qwen3.5 (hybrid Gated-DeltaNet linear attention, tied embeddings: Qwen3.5-4B's architecture)
through the front door: a server on a tiny random one, trained with the real tinker SDK on
packed batches; its export read by the cookbook's own ``weights`` tools, the merged model run by
transformers one sequence at a time; sampled with the trained adapter; resumed. The MoE variant
(Qwen3.6-35B-A3B's) runs the same way in ``tests/e2e/test_moe_sdk.py``."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.sdk import datum, download, forward_logprobs
from tests.support.server import ServerExited, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ALIAS = "tiny-qwen3.5"
SEQUENCES = [list(range(5, 45)), [7, 300, 12, 9, 60, 61], list(range(100, 171, 3))]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tiny_family):
    root = tmp_path_factory.mktemp("qwen3_5")
    model_dir = tiny_family("qwen3_5")
    server = start_server(root / "data", "--model", str(model_dir), alias=ALIAS)
    sc = tinker.ServiceClient(base_url=server.base_url)
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    losses = []
    for _ in range(4):  # three sequences packed into each pass
        result = tc.forward_backward([datum(s) for s in SEQUENCES], "cross_entropy").result()
        losses.append(result.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    yield {"server": server, "sc": sc, "tc": tc, "model_dir": model_dir, "losses": losses, "root": root}
    sc.close("success").result()
    server.stop()


def test_training_moves_every_linear_attention_lora_and_exports_tinkers_layout(hybrid):
    assert hybrid["losses"][-1] < hybrid["losses"][0]
    path = hybrid["tc"].save_weights_external("export").result().path
    adapter = download(hybrid["server"].base_url, path, hybrid["root"] / "export")
    from safetensors.torch import load_file

    weights = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.linear_attn"
    for target, rows in (("in_proj_q", 32), ("in_proj_k", 32), ("in_proj_v", 64), ("in_proj_z", 64)):
        assert weights[f"{prefix}.{target}.lora_A.weight"].shape == (4, 64)
        assert weights[f"{prefix}.{target}.lora_B.weight"].shape == (rows, 4)
        assert weights[f"{prefix}.{target}.lora_B.weight"].abs().sum() > 0  # trained
    assert f"{prefix}.out_proj.lora_A.weight" in weights
    assert not any(f"{prefix}.{name}." in k for k in weights for name in ("in_proj_qkv", "in_proj_a", "in_proj_b"))
    assert "base_model.model.model.unembed_tokens.lora_B.weight" in weights  # tied: the cookbook's embed_tokens


def test_the_cookbooks_merge_runs_each_sequence_as_the_packed_server_scores_it(hybrid):
    """One ``forward`` of three sequences (packed on the server) against the cookbook's merge of
    the export, run by transformers on each sequence alone: the linear-attention layers kept the
    sequences apart, and the q/k/v LoRA landed on the fused projection's rows as Tinker's do."""
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter
    from transformers import AutoModelForImageTextToText

    # Without the unembedding's LoRA: on a tied model the cookbook merges it into embed_tokens, the
    # input embeddings too, as it merges the service's (tests/e2e/test_checkpoints.py checks those weights)
    tc = hybrid["sc"].create_lora_training_client(base_model=ALIAS, rank=4, seed=2, train_unembed=False).result()
    for _ in range(2):
        tc.forward_backward([datum(s) for s in SEQUENCES], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_external("to-merge").result().path
    adapter = download(hybrid["server"].base_url, path, hybrid["root"] / "to-merge")
    merged = hybrid["root"] / "merged"
    build_hf_model(base_model=str(hybrid["model_dir"]), adapter_path=str(adapter), output_path=str(merged))
    # the checkpoint's own class (vision tower and all), as its users load it, in float64; ours is
    # float32, whose rounding a Gated-DeltaNet's q/k path carries further than a transformer's
    # (tests/unit/rank/test_linear_attention.py measures it): the bound is the unit tests' float32
    # one (2e-5; a position of this model measured 1.6e-5), or twice the merged model's own float32 error
    models = {
        dtype: AutoModelForImageTextToText.from_pretrained(merged, dtype=dtype).eval()
        for dtype in (torch.float32, torch.float64)
    }
    served = tc.forward([datum(s, 0.0) for s in SEQUENCES], "cross_entropy").result().loss_fn_outputs
    for tokens, out in zip(SEQUENCES, served, strict=True):
        theirs = {}
        for dtype, model in models.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
            theirs[dtype] = logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].double().numpy()
        float32_itself = np.abs(theirs[torch.float32] - theirs[torch.float64]).max()
        ours = out["logprobs"].to_numpy().astype(np.float64)
        np.testing.assert_allclose(ours, theirs[torch.float64], rtol=0, atol=max(2e-5, 2 * float32_itself))
    # the serving conversion (vLLM's layout) accepts it too
    build_lora_adapter(
        base_model=str(hybrid["model_dir"]), adapter_path=str(adapter), output_path=str(hybrid["root"] / "served")
    )
    assert (hybrid["root"] / "served" / "adapter_model.safetensors").exists()


def test_sampling_the_trained_adapter_scores_as_the_trainer(hybrid):
    sampler = hybrid["tc"].save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    for prompt in (SEQUENCES[0][:10], SEQUENCES[1][:3]):
        for seq in sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences:
            trainer = forward_logprobs(hybrid["tc"], prompt + seq.tokens)
            np.testing.assert_allclose(seq.logprobs, trainer[len(prompt) - 1 :], atol=1e-4)


def test_resume_continues_exactly(hybrid):
    sc, tc = hybrid["sc"], hybrid["tc"]
    state = tc.save_state("resume").result().path
    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    tokens = SEQUENCES[2]
    np.testing.assert_array_equal(forward_logprobs(resumed, tokens), forward_logprobs(tc, tokens))
    for client in (tc, resumed):
        client.forward_backward([datum(s) for s in SEQUENCES], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    np.testing.assert_array_equal(forward_logprobs(resumed, tokens), forward_logprobs(tc, tokens))


def test_the_server_says_what_it_trains(hybrid):
    health = httpx.get(f"{hybrid['server'].base_url}/healthz", timeout=10).raise_for_status().json()
    caps = health["capabilities"]
    assert (caps["arch"], caps["family"]) == ("Qwen3_5ForCausalLM", "qwen3_5")
    assert caps["linear_attention_layers"] == 1 and caps["routed_experts"] == 0 and caps["images"] is True


def test_vllm_is_refused_in_one_line_for_linear_attention_lora(hybrid):
    with pytest.raises(ServerExited) as failed:
        start_server(hybrid["root"] / "vllm", "--model", str(hybrid["model_dir"]), "--inference", "vllm", timeout=120)
    log = str(failed.value)
    assert "Qwen3_5ForCausalLM's Gated-DeltaNet attention has no kernels in vLLM's CPU build" in log
    assert "Traceback" not in log


def test_a_model_whose_recurrent_layers_cannot_be_packed_is_refused_in_one_line(tmp_path):
    """Qwen3-Next's Gated-DeltaNet (a fused q/k/v/z projection) is not Qwen3.5's: left to
    transformers it would run a packed row as one sequence. ``serve`` says so and stops."""
    import transformers

    from hosted_tinker.core.tiny_model import build_tokenizer

    config = transformers.Qwen3NextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    with pytest.raises(ServerExited) as failed:
        start_server(tmp_path / "data", "--model", str(tmp_path / "model"), timeout=120)
    log = str(failed.value)
    assert "Qwen3NextForCausalLM is not supported: its Qwen3NextGatedDeltaNet layers carry state" in log
    assert "Traceback" not in log
