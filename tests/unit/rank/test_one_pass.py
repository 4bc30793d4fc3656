"""Several models' requests in one pass over the base (``Trainer.forward_backward_many``), on one
in-process rank, against each request run alone: every loss, adapters of different ranks and
targets, forward-only passes, recomputed layers, and a failing request that fails alone. The
LoRA update the routing applies is PEFT's own (checked against PEFT's forward), and a seed
starts an adapter where PEFT starts it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.types import DatumInput, ForwardBackwardResult, LoraSpec, RequestFailed
from hosted_tinker.rank import adapters
from hosted_tinker.rank.model import load_base
from hosted_tinker.rank.serve import Rank, local_rank
from hosted_tinker.rank.trainer import Trainer
from tests.support.batches import random_batch

pytestmark = pytest.mark.fast

BATCHABLE = adapters._batchable
SPECS = {
    "m-attn": LoraSpec(rank=4, seed=1, train_mlp=False),
    "m-all": LoraSpec(rank=8, seed=2, train_unembed=True),
    "m-mlp": LoraSpec(rank=2, seed=3, train_attn=False),
}


@pytest.fixture(scope="module")
def rank(tiny_model_dir) -> Rank:
    return local_rank(str(tiny_model_dir))


@pytest.fixture()
def trainer(rank: Rank) -> Trainer:
    trainer = rank.trainer
    for model_id, spec in SPECS.items():
        trainer.create_adapter(model_id, spec)
        with torch.no_grad():  # B = 0 at creation: move off it so every adapter changes the logits
            for i, p in enumerate(trainer.adapters[model_id].handle.params):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(spec.seed * 1000 + i)) * 0.05)
    yield trainer
    for model_id in SPECS:
        trainer.delete_adapter(model_id)


def grads(trainer: Trainer, model_id: str) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in trainer.adapters[model_id].handle.params]


def clear(trainer: Trainer) -> None:
    for model_id in SPECS:
        for p in trainer.adapters[model_id].handle.params:
            p.grad = None


def assert_same(got: ForwardBackwardResult, want: ForwardBackwardResult) -> None:
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-5, abs=1e-5)
    assert got.metrics.keys() == want.metrics.keys()
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    for g, w in zip(got.elementwise_loss, want.elementwise_loss, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def assert_same_grads(got: list, want: list) -> None:
    scale = max(float(w.abs().max()) for w in want if w is not None)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale)


def alone(trainer: Trainer, requests: list) -> dict[str, tuple[ForwardBackwardResult, list]]:
    out = {}
    for model_id, batch in requests:
        out[model_id] = (trainer.forward_backward(model_id, batch), grads(trainer, model_id))
        clear(trainer)
    return out


@pytest.mark.parametrize("loss_fn", sorted(losses.LOSSES))
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_one_pass_equals_each_model_alone(trainer: Trainer, loss_fn: str, recompute: bool, monkeypatch):
    monkeypatch.setattr(trainer, "recompute_above_tokens", 0 if recompute else 10**9)
    monkeypatch.setattr(trainer, "microbatch_tokens", 120)  # micro-batches that mix models
    rng = np.random.default_rng(len(loss_fn))
    requests = [(model_id, random_batch(rng, size, loss_fn)) for model_id, size in zip(SPECS, (3, 2, 4), strict=True)]
    want = alone(trainer, requests)
    got = trainer.forward_backward_many(requests)
    for (model_id, _), result in zip(requests, got, strict=True):
        assert_same(result, want[model_id][0])
        assert_same_grads(grads(trainer, model_id), want[model_id][1])


EQUAL = {f"m-eq{i}": LoraSpec(rank=4, seed=20 + i, train_unembed=True) for i in range(3)}


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_equal_requests_run_batched_and_equal_each_model_alone(rank: Rank, recompute: bool, monkeypatch):
    """Models of one LoRA rank with requests of one length run each layer's LoRA as one
    batched matmul over the stacked adapters (``adapters.span_updates``), and still get what
    each gets alone."""
    trainer = rank.trainer
    for model_id, spec in EQUAL.items():
        trainer.create_adapter(model_id, spec)
        with torch.no_grad():
            for i, p in enumerate(trainer.adapters[model_id].handle.params):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(spec.seed * 1000 + i)) * 0.05)
    batched = []
    monkeypatch.setattr(adapters, "_batchable", lambda x, spans: batched.append(BATCHABLE(x, spans)) or batched[-1])
    monkeypatch.setattr(trainer, "recompute_above_tokens", 0 if recompute else 10**9)
    try:
        rng = np.random.default_rng(5)
        requests = [(model_id, random_batch(rng, 2, "importance_sampling", lengths=(20, 21))) for model_id in EQUAL]
        want = {}
        for model_id, batch in requests:
            want[model_id] = (trainer.forward_backward(model_id, batch), grads_of(trainer, model_id))
        got = trainer.forward_backward_many(requests)
        assert any(batched)
        for (model_id, _), result in zip(requests, got, strict=True):
            assert_same(result, want[model_id][0])
            assert_same_grads(grads_of(trainer, model_id), want[model_id][1])
    finally:
        for model_id in EQUAL:
            trainer.delete_adapter(model_id)


def grads_of(trainer: Trainer, model_id: str) -> list[torch.Tensor | None]:
    """``model_id``'s gradients, taken away (the next pass starts from none)."""
    out = grads(trainer, model_id)
    for p in trainer.adapters[model_id].handle.params:
        p.grad = None
    return out


def test_forward_only_requests_share_a_pass_and_leave_no_gradient(trainer: Trainer):
    rng = np.random.default_rng(3)
    requests = []
    for model_id in SPECS:
        batch = random_batch(rng, 2, "cross_entropy")
        batch.forward_only = True
        requests.append((model_id, batch))
    want = {m: r for m, (r, _) in alone(trainer, requests).items()}
    for (model_id, _), result in zip(requests, trainer.forward_backward_many(requests), strict=True):
        assert_same(result, want[model_id])
        assert all(g is None for g in grads(trainer, model_id))


def test_a_failing_request_fails_alone_and_leaves_no_trace(trainer: Trainer):
    """One model's request cannot be computed (its weights do not match its tokens): it fails
    with the error it gets alone; the other models' results and gradients are as if it had not
    been there, and each model's gradients accumulated before are kept."""
    rng = np.random.default_rng(9)
    before = random_batch(rng, 2, "cross_entropy")
    for model_id in SPECS:
        trainer.forward_backward(model_id, before)
    accumulated = {model_id: grads(trainer, model_id) for model_id in SPECS}
    requests = [(model_id, random_batch(rng, 3, "cross_entropy")) for model_id in SPECS]
    broken = requests[1][1].data[0]
    requests[1][1].data[0] = DatumInput(broken.tokens, broken.target_tokens, {"weights": torch.ones(2)})
    with pytest.raises(Exception) as alone_error:
        trainer.forward_backward("m-all", requests[1][1])
    for g, w in zip(grads(trainer, "m-all"), accumulated["m-all"], strict=True):
        assert torch.equal(g, w)

    got = trainer.forward_backward_many(requests)

    assert isinstance(got[1], RequestFailed) and got[1].kind == "error"
    assert str(alone_error.value) in got[1].message
    for g, w in zip(grads(trainer, "m-all"), accumulated["m-all"], strict=True):
        assert torch.equal(g, w)
    for i in (0, 2):
        model_id, batch = requests[i]
        now = grads(trainer, model_id)
        for p in trainer.adapters[model_id].handle.params:
            p.grad = None
        want, want_grads = trainer.forward_backward(model_id, batch), grads(trainer, model_id)
        assert_same(got[i], want)
        added = [g - a for g, a in zip(now, accumulated[model_id], strict=True)]
        assert_same_grads(added, want_grads)
    clear(trainer)


def clean_base(model):
    """The base model loaded again: a tree no hook of ours has touched."""
    return load_base(model.base.config.name_or_path, model.device, "float32")


def peft_twin(model, handle):
    """PEFT's own model of ``handle``'s adapter: ``get_peft_model`` on the base loaded again,
    with the adapter's ``adapter_config.json`` and tensors."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = model.adapter_config(handle)
    fields = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "lora_dropout")}
    peft = get_peft_model(clean_base(model), LoraConfig(**fields))
    state = {k: p.detach() for k, p in zip(handle.keys, handle.params, strict=True)}
    assert not set_peft_model_state_dict(peft, state).unexpected_keys
    return peft


def test_the_routed_update_is_peft_own(trainer: Trainer):
    """The hooks add what PEFT's own LoRA forward adds, for an adapter on every target (its
    output layer included)."""
    model = trainer.model
    handle = trainer.adapters["m-all"].handle
    data = random_batch(np.random.default_rng(4), 1, lengths=(30, 31)).data
    with torch.no_grad():
        ours = model.logprobs([handle], data)[0]
        logits = peft_twin(model, handle)(input_ids=data[0].tokens[None]).logits[0].float()
    theirs = logits.log_softmax(-1).gather(-1, data[0].target_tokens[:, None])[:, 0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "spec", [LoraSpec(rank=8, seed=7, train_unembed=True), LoraSpec(rank=4, seed=8, train_attn=False)]
)
def test_a_seed_starts_an_adapter_where_peft_starts_it(rank: Rank, spec: LoraSpec):
    """Same tensors under the same keys, in the same order, as ``get_peft_model`` draws for the
    seed and the modules; and the same ``adapter_config.json`` but for how it lists them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model = rank.trainer.model
    handle = model.add_adapter(spec)
    try:
        config = model.adapter_config(handle)
        fields = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "lora_dropout")}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            peft = get_peft_model(clean_base(model), LoraConfig(**fields))
        theirs = get_peft_model_state_dict(peft, save_embedding_layers=False)
        assert list(theirs) == handle.keys
        for key, p in zip(handle.keys, handle.params, strict=True):
            assert torch.equal(p.detach(), theirs[key]), key
        peft_config = peft.peft_config["default"].to_dict()
        for key, value in config.items():
            if key not in ("target_modules", "base_model_name_or_path", "revision", "task_type"):
                assert value == peft_config[key], key
    finally:
        model.remove_adapter(handle)
