"""Mixture-of-experts models through the front door: a server started on a tiny random Qwen3-MoE
(fused experts, as transformers 5 builds Qwen3-30B-A3B), DeepSeek-V3 (MLA, a dense first
layer, shared experts: Kimi-K2's architecture), Qwen3.5-MoE (Qwen3.6-35B-A3B's: hybrid
linear attention, a gated shared expert), gpt-oss or Qwen3-VL-MoE (its language model), trained
with the real tinker SDK; its export downloaded through the SDK's signed URLs and read by the
cookbook's own ``weights`` tools, as a user of the service would read what the service wrote. The
same on the megatron backend with DeepSeek-V3's latent attention, dense layer and shared experts,
and with Qwen3.5-MoE's linear attention and gated shared expert, split over two ranks by tensor
parallelism and their routed experts split over the same two (``tp=2 ep=2``, sequence-parallel;
Qwen3-MoE's megatron layouts: test_plans.py, test_megatron.py, test_nodes.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.sdk import datum, download, forward_logprobs, rl_datum
from tests.support.server import ServerExited, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ALIAS = "tiny-moe"
TOKENS = list(range(5, 45))
ARCHS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",  # and hybrid linear attention
    "gpt_oss": "GptOssForCausalLM",  # attention sinks, sliding windows, interleaved experts with biases
    "qwen3_vl_moe": "Qwen3VLMoeForCausalLM",  # Qwen3-VL-30B-A3B's language model (``rank.vision``)
}

# each server: the family's model, and the serve flags beyond it (the peft backend's HF path, or
# megatron-core's tensor and expert parallelism)
TP2_EP2 = ("--backend", "megatron", "--train-devices", "cpu:2") + tuple(
    f for option in ("tp=2", "ep=2", "sequence_parallel=true") for f in ("--backend-option", option)
)
SERVERS = {family: (family, ()) for family in ARCHS} | {
    f"{family}-megatron-tp2-ep2": (family, TP2_EP2) for family in ("deepseek_v3", "qwen3_5_moe")
}


def hf_model(path):
    """transformers' model of a checkpoint, as its users load it: a vision-language one whole."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    return (
        (AutoModelForImageTextToText if vision else AutoModelForCausalLM)
        .from_pretrained(path, dtype=torch.float32)
        .eval()
    )


@pytest.fixture(scope="module", params=list(SERVERS))
def moe(request, tmp_path_factory, tiny_family):
    """The server, a model trained a few steps on it, and the model's folder."""
    root = tmp_path_factory.mktemp(request.param)
    family, flags = SERVERS[request.param]
    model_dir = tiny_family(family)
    server = start_server(root / "data", "--model", str(model_dir), *flags, alias=ALIAS)
    sc = tinker.ServiceClient(base_url=server.base_url)
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    losses = []
    for _ in range(4):
        losses.append(tc.forward_backward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    arch = ARCHS[family]
    yield {"server": server, "sc": sc, "tc": tc, "model_dir": model_dir, "losses": losses, "root": root, "arch": arch}
    sc.close("success").result()
    server.stop()


def test_training_moves_the_experts_and_the_export_holds_them_as_tinker_does(moe):
    assert moe["losses"][-1] < moe["losses"][0]
    path = moe["tc"].save_weights_external("experts").result().path
    adapter = download(moe["server"].base_url, path, moe["root"] / "export")
    from safetensors.torch import load_file

    weights = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.unembed_tokens.lora_B.weight" in weights  # Tinker's name for lm_head's
    if moe["arch"] == "GptOssForCausalLM":  # the service names gpt-oss's attention attn
        assert any(".attn.q_proj." in k for k in weights) and not any(".self_attn." in k for k in weights)
    assert not any(".lm_head." in k for k in weights)
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(moe["model_dir"]).get_text_config()
    inner = getattr(text, "moe_intermediate_size", None) or text.intermediate_size  # gpt-oss: the latter
    for layer in (1,) if moe["arch"] == "DeepseekV3ForCausalLM" else (0, 1):  # DeepSeek's layer 0 is dense
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        assert weights[f"{prefix}.w1.lora_A.weight"].shape == (1, 4, 64)  # one for all experts
        assert weights[f"{prefix}.w3.lora_B.weight"].shape == (8, inner, 4)  # each expert's
        assert weights[f"{prefix}.w2.lora_A.weight"].shape == (8, 4, inner)
        assert weights[f"{prefix}.w2.lora_B.weight"].shape == (1, 64, 4)
        assert weights[f"{prefix}.w2.lora_B.weight"].abs().sum() > 0  # trained, not the zeros it starts at


def test_the_cookbooks_merge_of_the_export_scores_as_the_server_does(moe):
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter

    path = moe["tc"].save_weights_external("to-merge").result().path
    adapter = download(moe["server"].base_url, path, moe["root"] / "to-merge")
    merged = moe["root"] / "merged"
    build_hf_model(base_model=str(moe["model_dir"]), adapter_path=str(adapter), output_path=str(merged))
    model = hf_model(merged)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    theirs = logits.log_softmax(-1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(theirs, forward_logprobs(moe["tc"], TOKENS), rtol=0, atol=1e-5)

    # the serving conversion: every expert's LoRA as its own PEFT module (vLLM's layout); the
    # cookbook refuses it for DeepSeek-V3, whose LoRA neither vLLM nor SGLang serve
    served = moe["root"] / "served"
    if moe["arch"] == "DeepseekV3ForCausalLM":
        from tinker_cookbook.exceptions import WeightsAdapterError

        with pytest.raises(WeightsAdapterError, match="does not support LoRA adapter serving"):
            build_lora_adapter(base_model=str(moe["model_dir"]), adapter_path=str(adapter), output_path=str(served))
        return
    build_lora_adapter(base_model=str(moe["model_dir"]), adapter_path=str(adapter), output_path=str(served))
    from safetensors.torch import load_file

    peft = load_file(served / "adapter_model.safetensors")
    layers = 1 if moe["arch"] == "DeepseekV3ForCausalLM" else 2
    routed = [k for k in peft if ".experts." in k and ".shared_experts." not in k]
    assert len(routed) == layers * 3 * 8 * 2  # layers × projections × experts × (A, B)


def test_sampling_the_trained_experts_scores_as_the_trainer(moe):
    sampler = moe["tc"].save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:10]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    for seq in sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences:
        trainer = forward_logprobs(moe["tc"], prompt + seq.tokens)
        np.testing.assert_allclose(seq.logprobs, trainer[len(prompt) - 1 :], atol=1e-4)


def test_the_sampled_routing_is_replayed_when_the_samples_train(moe):
    """Routing replay: a sampler made with record_stability_info records each token's experts, and
    a forward on those tokens with provenance runs them: every input position's routing is the
    sampler's (its prompt and sampled[:-1]); on the weights that sampled, they are the learner's
    own choices too. After a step the learner's routers would choose otherwise for some tokens,
    and the record still decides; the same data without provenance has nothing to replay."""
    fresh = moe["sc"].create_lora_training_client(base_model=ALIAS, rank=4, seed=11).result()
    sampler = fresh.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = TOKENS[:10]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    data = [rl_datum(s, 1.0, prompt) for s in seqs]
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in data]
    on_policy = fresh.forward(data, "importance_sampling").result().metrics
    assert on_policy["routing_replayed:mean"] == 1.0 and on_policy["routing_replay_changed:mean"] == 0.0
    assert on_policy["sampler_logprob_gap:max"] < 1e-4

    fresh.forward_backward([datum(TOKENS)], "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=0.5)).result()
    replayed, unreplayed = (fresh.forward(d, "importance_sampling").result() for d in (data, plain))
    assert replayed.metrics["routing_replayed:mean"] == 1.0
    assert replayed.metrics["routing_replay_changed:mean"] > 0
    assert "routing_replayed:mean" not in unreplayed.metrics
    differ = [
        np.abs(r["logprobs"].to_numpy() - u["logprobs"].to_numpy()).max()
        for r, u in zip(replayed.loss_fn_outputs, unreplayed.loss_fn_outputs, strict=True)
    ]
    assert max(differ) > 1e-4


def test_a_keys_routing_is_kept_up_to_its_record_bytes(tmp_path, tiny_family):
    """Routing is ~100 times a record's tokens: a key keeps at most its ``record_bytes`` of it in
    live records (``--key-limit``). Past it, its new records keep their tokens and log-probs (the
    datum still trains, ``routing_replayed:mean`` says 0), and another key keeps its own."""
    import json

    from tests.support.tenants import new_keys

    model = tiny_family("qwen3_moe")
    config = json.loads((model / "config.json").read_text())
    row = config["num_hidden_layers"] * config["num_experts_per_tok"] * 2  # int16 experts of a token
    one_request = 2 * 128 + (10 + 8) * row  # the prompt's and the sequence's .npy: header, rows
    key_a, key_b = new_keys(tmp_path, "alice", "bob")
    srv = start_server(tmp_path, "--model", str(model), "--key-limit", f"record_bytes={one_request}", alias=ALIAS)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    prompt = TOKENS[:10]
    try:
        replayed = {}
        for name, key in (("alice", key_a), ("bob", key_b)):
            tc = tinker.ServiceClient(base_url=srv.base_url, api_key=key).create_lora_training_client(
                base_model=ALIAS, rank=4, seed=0
            )
            sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True)
            for turn in range(2 if name == "alice" else 1):
                (seq,) = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences
                out = tc.forward([rl_datum(seq, 1.0, prompt)], "importance_sampling").result()
                replayed[name, turn] = out.metrics["routing_replayed:mean"]
        assert replayed == {("alice", 0): 1.0, ("alice", 1): 0.0, ("bob", 0): 1.0}
        log = srv.log_path.read_text()
        assert "record_bytes limit of routing" in log and key_a not in log  # the key's name, never the key
    finally:
        srv.stop()


def test_resume_continues_exactly(moe):
    """save_state, then a new client from it: the same scores, and the same next step."""
    sc, tc = moe["sc"], moe["tc"]
    state = tc.save_state("resume").result().path
    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    np.testing.assert_array_equal(forward_logprobs(resumed, TOKENS), forward_logprobs(tc, TOKENS))
    for client in (tc, resumed):
        client.forward_backward([datum(TOKENS)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    np.testing.assert_array_equal(forward_logprobs(resumed, TOKENS), forward_logprobs(tc, TOKENS))


def test_forward_backward_reports_the_services_moe_metrics(moe):
    """The five routing metrics the SDK documents for MoE training, over the request's tokens:
    for a new model (its LoRA changes nothing yet) they are those of the base model's own routers."""
    from hosted_tinker.core.routing import routing_metrics

    fresh = moe["sc"].create_lora_training_client(base_model=ALIAS, rank=4, seed=9).result()
    metrics = fresh.forward_backward([datum(TOKENS)], "cross_entropy").result().metrics
    base = hf_model(moe["model_dir"])
    counts = []
    for module in base.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
            module.register_forward_pre_hook(
                lambda m, args: counts.append(np.bincount(args[1].reshape(-1).numpy(), minlength=m.num_experts))
            )
    with torch.no_grad():
        base(input_ids=torch.tensor([TOKENS[:-1]]))
    expected = routing_metrics(np.stack(counts))
    assert set(expected) == {
        "e_frac_with_tokens:mean",
        "e_frac_oversubscribed:mean",
        "e_max_violation:mean",
        "e_max_violation:max",
        "e_min_violation:mean",
    }
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)


def test_the_server_says_it_trains_the_experts(moe):
    health = httpx.get(f"{moe['server'].base_url}/healthz", timeout=10).raise_for_status().json()
    assert health["capabilities"]["arch"] == moe["arch"]
    assert health["capabilities"]["routed_experts"] == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_vllm_is_refused_in_one_line_for_expert_lora(family, tmp_path, tiny_family):
    """vLLM's CPU build has no kernels for LoRA on experts, and no vLLM decodes DeepSeek's latent
    attention with its kv_b_proj LoRA: the server says so at start, naming the model, rather than
    sample adapters without what they trained. Every family's reason is
    ``tests/unit/inference/test_vllm_layout.py``'s; here, that ``serve`` says it in one line."""
    model_dir = tiny_family(family)
    with pytest.raises(ServerExited) as failed:
        start_server(tmp_path / "data", "--model", str(model_dir), "--inference", "vllm", timeout=120)
    log, arch = str(failed.value), ARCHS[family]
    why = " has multi-head latent attention" if family == "deepseek_v3" else "'s LoRA on routed experts has no kernels"
    assert arch + why in log and "Traceback" not in log


@pytest.mark.parametrize("moe", ["deepseek_v3-megatron-tp2-ep2"], indirect=True)
def test_a_rank_killed_mid_step_fails_that_request_and_the_expert_group_comes_back(moe):
    """A dead rank of an expert-parallel group (whose peer waits for it inside a MoE layer) fails
    the request it was running, naming it; the group is replaced and the model comes back from its
    checkpoint on both ranks, each with its own experts. Last of the module: it restarts the ranks."""
    from tests.support.faults import kill_a_rank_mid_step

    tc, base_url = moe["tc"], moe["server"].base_url
    path = tc.save_state("before-the-kill").result().path
    at_save = forward_logprobs(tc, TOKENS)
    failure, old = kill_a_rank_mid_step(tc, base_url, rank=1)
    assert failure.category == types.RequestErrorCategory.Server
    assert f"training rank 1 (pid {old[1]}) was killed by SIGKILL" in str(failure)
    assert f"was restored from {path}" in str(failure)
    worker = httpx.get(f"{base_url}/healthz", timeout=10).raise_for_status().json()["worker"]
    assert worker["alive"] and worker["restarts"] == 1 and not set(worker["pids"]) & set(old)
    np.testing.assert_array_equal(forward_logprobs(tc, TOKENS), at_save)
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
