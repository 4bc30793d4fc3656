"""End-to-end: the real tinker 0.38 SDK trains LoRA adapters on a live server, on the peft
backend (the session's shared server), the ddp backend (two gloo ranks) and the megatron
backend (two tensor-parallel gloo ranks)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.server import ALIAS, ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


LAYOUTS = {
    "ddp": ("--backend", "ddp", "--train-devices", "cpu:2"),
    "megatron": ("--backend", "megatron", "--train-devices", "cpu:2", "--backend-option", "tp=2"),
}


@pytest.fixture(scope="module", params=["peft", *LAYOUTS])
def base_url(request, server: ServerProcess, tmp_path_factory, tiny_model_dir) -> str:
    """Every test here runs against every backend."""
    if request.param == "peft":
        yield server.base_url
        return
    other = start_server(tmp_path_factory.mktemp(request.param), *LAYOUTS[request.param])
    assert capabilities(other.base_url)["devices"] == ["cpu", "cpu"]
    yield other.base_url
    other.stop()


def capabilities(base_url: str) -> dict:
    import httpx

    return httpx.get(f"{base_url}/healthz", timeout=5).json()["capabilities"]


CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def sft_datum(tokenizer, messages=CHAT) -> types.Datum:
    """Input = tokens[:-1], target = tokens[1:], weight 1 on the assistant reply only."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
    full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False).rstrip("\n"))
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def logprobs_of(result) -> list[np.ndarray]:
    return [out["logprobs"].to_numpy() for out in result.loss_fn_outputs]


def weights_of(datum: types.Datum) -> np.ndarray:
    return datum.loss_fn_inputs["weights"].to_numpy()


def train(tc, data, steps: int, adam: types.AdamParams) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam)
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_sft_learns_the_chat(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
    datum = sft_datum(tokenizer)
    losses = train(tc, [datum] * 4, 30, types.AdamParams(learning_rate=2e-3))
    assert losses[-1] < 0.3 * losses[0], losses

    result = tc.forward([datum], "cross_entropy").result()
    lp, w = logprobs_of(result)[0], weights_of(datum)
    assert np.exp(lp[w > 0]).min() > 0.5
    # loss:sum is exactly Σ −w·logprob of the returned logprobs.
    assert result.metrics["loss:sum"] == pytest.approx(float(-(w * lp).sum()), rel=1e-5, abs=1e-6)


def test_info_and_tokenizer(service_client):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == ALIAS
    assert info.model_id.startswith(tc.holder.get_session_id() if hasattr(tc, "holder") else "")
    assert ":train:" in info.model_id
    assert info.lora_rank == 4
    tok = tc.get_tokenizer()
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_split_batch_equals_one_batch(service_client, tokenizer):
    data = [sft_datum(tokenizer)] + [
        sft_datum(tokenizer, [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} ok"}])
        for i in range(3)
    ]
    # Adam divides each coordinate by its own magnitude, so float32 rounding in a coordinate whose
    # true gradient is ~0 (split and whole batches are padded differently) becomes a ±lr step.
    # A large eps makes the update a smooth function of the gradient, which is what is compared.
    adam = types.AdamParams(learning_rate=5e-3, eps=1.0)
    one = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=7).result()
    split = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=7).result()
    for _ in range(2):
        a = one.forward_backward(data, "cross_entropy")
        step_one = one.optim_step(adam).result()
        b1 = split.forward_backward(data[:1], "cross_entropy")
        b2 = split.forward_backward(data[1:], "cross_entropy")
        step_split = split.optim_step(adam).result()
        assert a.result().metrics["loss:sum"] == pytest.approx(
            b1.result().metrics["loss:sum"] + b2.result().metrics["loss:sum"], rel=1e-5
        )
        assert step_one.metrics["grad_norm"] == pytest.approx(step_split.metrics["grad_norm"], rel=1e-5)
    after_one = logprobs_of(one.forward(data, "cross_entropy").result())
    after_split = logprobs_of(split.forward(data, "cross_entropy").result())
    diff = max(np.abs(x - y).max() for x, y in zip(after_one, after_split, strict=True))
    assert diff < 1e-5


def test_lr_zero_changes_nothing(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=3).result()
    data = [sft_datum(tokenizer)]
    train(tc, data, 2, types.AdamParams(learning_rate=5e-3))  # make lora_B non-zero first
    before = logprobs_of(tc.forward(data, "cross_entropy").result())[0]
    train(tc, data, 2, types.AdamParams(learning_rate=0.0))
    after = logprobs_of(tc.forward(data, "cross_entropy").result())[0]
    np.testing.assert_array_equal(before, after)


def test_weight_decay_and_grad_clip_take_effect(service_client, tokenizer):
    data = [sft_datum(tokenizer)] * 2
    curves = {}
    for name, adam in {
        "plain": types.AdamParams(learning_rate=5e-3),
        "decay": types.AdamParams(learning_rate=5e-3, weight_decay=0.5),
        "clip": types.AdamParams(learning_rate=5e-3, grad_clip_norm=1e-3),
    }.items():
        tc = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=11).result()
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            metrics = tc.optim_step(adam).result().metrics
            losses.append(fb.result().metrics["loss:sum"])
        curves[name] = (losses, metrics)
    plain, decay, clip = curves["plain"][0], curves["decay"][0], curves["clip"][0]
    assert plain[0] == decay[0] == clip[0]  # same seed, same start
    assert decay[2] != pytest.approx(plain[2], rel=1e-6)
    # Adam normalises the gradient scale away except through eps, so clipping shows in the
    # reported norm and in the update only once moments mix clipped and unclipped steps.
    assert curves["clip"][1]["grad_norm"] > 1e-3
    assert clip[2] != pytest.approx(plain[2], rel=1e-6)


def test_concurrent_clients_do_not_disturb_each_other(base_url, tokenizer):
    data_a = [sft_datum(tokenizer)] * 2
    data_b = [sft_datum(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])]
    adam = types.AdamParams(learning_rate=3e-3)

    def run(data, seed, out, key):
        with tinker.ServiceClient(base_url=base_url) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=seed).result()
            out[key] = train(tc, data, 8, adam)

    solo: dict = {}
    run(data_a, 5, solo, "a")
    both: dict = {}
    threads = [
        threading.Thread(target=run, args=(data_a, 5, both, "a")),
        threading.Thread(target=run, args=(data_b, 6, both, "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert both["a"] == solo["a"]
    assert len(both["b"]) == 8


def test_rl_losses_match_their_formulas(service_client, tokenizer):
    """loss:sum of each RL loss equals §7's formula evaluated on the returned logprobs."""
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=8, seed=2).result()
    base = sft_datum(tokenizer)
    n = base.model_input.length
    rng = np.random.default_rng(0)
    lp_now = logprobs_of(tc.forward([base], "cross_entropy").result())[0].astype(np.float64)
    q = (lp_now + rng.normal(0, 0.3, n)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    mask = (rng.random(n) > 0.3).astype(np.float32)
    targets = base.loss_fn_inputs["target_tokens"].to_numpy().tolist()
    r = np.exp(lp_now - q)

    def datum(**extra):
        inputs = {"target_tokens": targets, "logprobs": q.tolist(), "advantages": adv.tolist(), **extra}
        return types.Datum(model_input=base.model_input, loss_fn_inputs=inputs)

    def clip(x, lo, hi):
        return np.clip(x, lo, hi)

    s = np.exp(((lp_now - q) * mask).sum() / mask.sum())
    expected = {
        ("importance_sampling", None): -(r * adv).sum(),
        ("ppo", None): -np.minimum(r * adv, clip(r, 0.8, 1.2) * adv).sum(),
        ("ppo", (0.9, 1.1)): -np.minimum(r * adv, clip(r, 0.9, 1.1) * adv).sum(),
        ("cispo", None): -(clip(r, 0.0, 4.0) * lp_now * adv).sum(),
        ("dro", None): -(lp_now * adv - 0.5 * 0.05 * (lp_now - q) ** 2).sum(),
        ("gspo", None): -np.minimum(s * adv, clip(s, 0.8, 1.2) * adv).sum(),
    }
    for (loss_fn, thresholds), value in expected.items():
        config = (
            None
            if thresholds is None
            else dict(zip(("clip_low_threshold", "clip_high_threshold"), thresholds, strict=True))
        )
        d = datum(sequence_ratio_mask=mask.tolist()) if loss_fn == "gspo" else datum()
        out = tc.forward([d], loss_fn, loss_fn_config=config).result()
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-4, abs=1e-4), loss_fn
        np.testing.assert_allclose(logprobs_of(out)[0], lp_now, atol=1e-5)


def test_topk_targets_and_negative_weights(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    base = sft_datum(tokenizer)
    n = base.model_input.length
    targets = np.stack([base.loss_fn_inputs["target_tokens"].to_numpy(), np.full(n, 7), np.full(n, 9)], axis=1)
    weights = np.random.default_rng(1).normal(0, 1, (n, 3)).astype(np.float32)
    d = types.Datum(
        model_input=base.model_input,
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets.astype(np.int64)),
            "weights": types.TensorData.from_numpy(weights),
        },
    )
    out = tc.forward_backward([d], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy().reshape(n, 3)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(weights * lp).sum()), rel=1e-4, abs=1e-4)
    assert (lp < 0).all()


def test_cross_entropy_without_weights_counts_every_position_once(service_client, tokenizer):
    """As the SDK's own examples of forward / forward_backward send it: target_tokens alone. The
    loss is that of weights 1 (#43 item 4), and the same step follows."""
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    weighted = sft_datum(tokenizer)
    n = weighted.model_input.length
    weighted = types.Datum(
        model_input=weighted.model_input,
        loss_fn_inputs={"target_tokens": weighted.loss_fn_inputs["target_tokens"], "weights": [1.0] * n},
    )
    bare = types.Datum(
        model_input=weighted.model_input, loss_fn_inputs={"target_tokens": weighted.loss_fn_inputs["target_tokens"]}
    )
    with_ones = tc.forward([weighted], "cross_entropy").result()
    without = tc.forward([bare], "cross_entropy").result()
    assert without.metrics["loss:sum"] == with_ones.metrics["loss:sum"]
    lp = without.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert without.metrics["loss:sum"] == pytest.approx(float(-lp.sum()), rel=1e-5)


def test_forward_backward_custom(service_client, tokenizer):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4, seed=4).result()
    data = [sft_datum(tokenizer)] * 2

    def loss_fn(data, logprobs_list):
        loss = sum((lp**2).sum() for lp in logprobs_list) * 0.01
        return loss, {"custom_metric:sum": float(loss)}

    out = tc.forward_backward_custom(data, loss_fn).result()
    lps = [torch.tensor(x) for x in logprobs_of(out)]
    assert out.metrics["loss:sum"] == pytest.approx(float(sum((lp**2).sum() for lp in lps) * 0.01), rel=1e-4)
    assert "surrogate_loss:sum" in out.metrics
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_clear_errors(service_client, tokenizer):
    with pytest.raises(tinker.BadRequestError, match="served names"):
        service_client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4).result()
    datum = sft_datum(tokenizer)
    for loss_fn in ("custom", "nonsense"):
        with pytest.raises(tinker.BadRequestError, match=loss_fn):
            tc.forward_backward([datum], loss_fn).result()
    with pytest.raises(tinker.BadRequestError, match="advantages is required"):
        tc.forward_backward([datum], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn_inputs.logprobs is required"):
        tc.forward_backward([datum], "ppo").result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config.bogus"):
        tc.forward_backward([datum], "ppo", loss_fn_config={"bogus": 1.0}).result()
    # A rejected request consumed its seq_id: the model keeps working afterwards.
    assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_rest_capabilities(base_url):
    rest = tinker.ServiceClient(base_url=base_url).create_rest_client()
    caps = rest.get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert ALIAS in names
