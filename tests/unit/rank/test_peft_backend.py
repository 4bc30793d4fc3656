"""One rank in-process (the single plan: HF + PEFT): AdamW and clipping against an independent
float64 reference, gradient accumulation, seeded initialisation, a base model that never
changes, and the embedded sampler beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.core.types import AdamParams, DatumInput, ForwardBackwardBatch, LoraSpec
from hosted_tinker.rank.serve import Rank, local_rank
from hosted_tinker.rank.trainer import Trainer

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def rank(tiny_model_dir) -> Rank:
    return local_rank(str(tiny_model_dir))


@pytest.fixture(scope="module")
def backend(rank: Rank) -> Trainer:
    return rank.trainer


def datum(seed: int, length: int = 12) -> DatumInput:
    tokens = torch.from_numpy(np.random.default_rng(seed).integers(10, 500, length + 1))
    return DatumInput(tokens=tokens[:-1], target_tokens=tokens[1:], inputs={"weights": torch.ones(length)})


def ce(data: list[DatumInput]) -> ForwardBackwardBatch:
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def snapshot(backend: Trainer, model_id: str) -> list[np.ndarray]:
    return [p.detach().double().numpy().copy() for p in backend.adapters[model_id].handle.params]


def grads(backend: Trainer, model_id: str) -> list[np.ndarray]:
    return [p.grad.detach().double().numpy().copy() for p in backend.adapters[model_id].handle.params]


def test_adamw_with_decay_and_clipping_matches_float64_reference(backend: Trainer):
    backend.create_adapter("opt", LoraSpec(rank=4, seed=0))
    params = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3, grad_clip_norm=0.5)
    p = snapshot(backend, "opt")
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for step in (1, 2, 3):
        backend.forward_backward("opt", ce([datum(step), datum(step + 10)]))
        g = grads(backend, "opt")
        norm = np.sqrt(sum((x**2).sum() for x in g))
        scale = min(1.0, params.grad_clip_norm / norm)
        metrics = backend.optim_step("opt", params)
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
        for i, gi in enumerate(g):
            gi = gi * scale
            m[i] = params.beta1 * m[i] + (1 - params.beta1) * gi
            v[i] = params.beta2 * v[i] + (1 - params.beta2) * gi**2
            m_hat = m[i] / (1 - params.beta1**step)
            v_hat = v[i] / (1 - params.beta2**step)
            p[i] = p[i] * (1 - params.learning_rate * params.weight_decay)
            p[i] = p[i] - params.learning_rate * m_hat / (np.sqrt(v_hat) + params.eps)
        got = snapshot(backend, "opt")
        assert max(np.abs(a - b).max() for a, b in zip(got, p, strict=True)) < 1e-6
    assert all(x.grad is None for x in backend.adapters["opt"].handle.params)  # cleared by the step
    backend.delete_adapter("opt")


def test_gradients_accumulate_across_calls(backend: Trainer):
    backend.create_adapter("one", LoraSpec(rank=4, seed=1))
    backend.create_adapter("two", LoraSpec(rank=4, seed=1))
    backend.optim_step("one", AdamParams(learning_rate=0.0))  # nothing accumulated yet: a no-op
    d = [datum(1), datum(2, length=20), datum(3, length=5)]
    backend.forward_backward("one", ce(d))
    backend.forward_backward("two", ce(d[:1]))
    backend.forward_backward("two", ce(d[1:]))
    # Equal up to float32 summation order: padding to another batch shape reorders reductions.
    for a, b in zip(grads(backend, "one"), grads(backend, "two"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    backend.delete_adapter("one")
    backend.delete_adapter("two")


def test_seeded_init_and_untouched_base(backend: Trainer):
    base_before = {k: v.clone() for k, v in backend.model.adapters.lm.state_dict().items() if "lora" not in k}
    backend.create_adapter("s5", LoraSpec(rank=8, seed=5))
    backend.create_adapter("s5b", LoraSpec(rank=8, seed=5))
    backend.create_adapter("s6", LoraSpec(rank=8, seed=6, train_unembed=False))
    for a, b in zip(snapshot(backend, "s5"), snapshot(backend, "s5b"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(backend.adapters["s6"].handle.params) < len(backend.adapters["s5"].handle.params)  # no lm_head LoRA
    for _ in range(3):
        backend.forward_backward("s5", ce([datum(0)]))
        backend.optim_step("s5", AdamParams(learning_rate=1e-2))
    # The other adapters (same seed) are untouched by s5's training.
    assert not np.array_equal(snapshot(backend, "s5")[0], snapshot(backend, "s5b")[0])
    before_s5b = backend.forward_backward("s5b", ForwardBackwardBatch([datum(0)], "cross_entropy", {}, True))
    for name in ("s5", "s5b", "s6"):
        backend.delete_adapter(name)
    base_after = {k: v for k, v in backend.model.adapters.lm.state_dict().items() if "lora" not in k}
    assert base_before.keys() == base_after.keys()
    for k, v in base_before.items():
        assert torch.equal(v, base_after[k]), k
    assert before_s5b.loss_sum > 0


def test_a_failed_request_leaves_accumulated_gradients_untouched(backend: Trainer, monkeypatch):
    backend.create_adapter("fail", LoraSpec(rank=4, seed=2))
    backend.forward_backward("fail", ce([datum(1)]))
    before = grads(backend, "fail")
    calls = {"n": 0}
    real = backend.model.logprobs

    def flaky(handle, data, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated out-of-memory in the second micro-batch")
        return real(handle, data, **kwargs)

    monkeypatch.setattr(backend.model, "logprobs", flaky)
    monkeypatch.setattr(backend, "microbatch_tokens", 12)  # one datum per micro-batch
    with pytest.raises(RuntimeError, match="simulated"):
        backend.forward_backward("fail", ce([datum(2), datum(3)]))
    for a, b in zip(before, grads(backend, "fail"), strict=True):
        np.testing.assert_array_equal(a, b)
    backend.delete_adapter("fail")


def test_requests_admitted_mid_decode_match_solo_runs(rank: Rank):
    from hosted_tinker.core.sampling import Admission, SampleSpec

    first = SampleSpec(prompt=list(range(10, 40)), max_tokens=12, temperature=0.0)
    late = [
        SampleSpec(prompt=list(range(50, 55)), max_tokens=8, temperature=0.0),
        SampleSpec(prompt=list(range(60, 120)), max_tokens=6, num_samples=2, temperature=1.0, seed=7),
    ]
    calls = []

    def admit() -> Admission:
        calls.append(1)
        return Admission(late if len(calls) == 3 else [])  # join after a few decode steps

    together = rank.sampler.generate(None, [first], admit)
    alone = [rank.sampler.generate(None, [spec])[0] for spec in (first, *late)]
    assert len(together) == 3
    for joint, solo in zip(together, alone, strict=True):
        for a, b in zip(joint.sequences, solo.sequences, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_each_request_gets_its_own_top_k_from_one_pass_over_the_rows(rank: Rank):
    """Rows asking for different k (and none) in one decode: each gets its k best tokens, best
    first, as arrays; the greedy token is the best one, with its own log-prob."""
    from hosted_tinker.core.sampling import SampleSpec

    specs = [
        SampleSpec(prompt=list(range(10, 30)), max_tokens=5, temperature=0.0, topk_sample_logprobs=k) for k in (3, 0, 7)
    ]
    outputs = rank.sampler.generate(None, specs)
    assert outputs[1].sequences[0].topk is None
    for k, out in ((3, outputs[0]), (7, outputs[2])):
        seq = out.sequences[0]
        ids, lps = seq.topk
        assert ids.shape == lps.shape == (5, k) and ids.dtype == np.int32 and lps.dtype == np.float32
        assert (np.diff(lps, axis=1) <= 0).all() and ids[:, 0].tolist() == seq.tokens
        np.testing.assert_allclose(lps[:, 0], seq.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(outputs[0].sequences[0].topk[0], outputs[2].sequences[0].topk[0][:, :3])


def test_dropped_requests_leave_the_decode_and_the_others_are_unchanged(rank: Rank):
    from hosted_tinker.core.sampling import Admission, SampleSpec

    kept = SampleSpec(prompt=list(range(10, 30)), max_tokens=10, temperature=1.0, seed=3, stop_token_ids=frozenset())
    doomed = SampleSpec(prompt=list(range(40, 50)), max_tokens=200, num_samples=3, temperature=1.0, seed=4)
    calls = []

    def admit() -> Admission:
        calls.append(1)
        return Admission(dropped=(1,) if len(calls) == 2 else ())  # its client gave up after two steps

    kept_out, doomed_out = rank.sampler.generate(None, [kept, doomed], admit)
    assert [len(s.tokens) for s in doomed_out.sequences] == [2, 2, 2]  # stopped, not decoded to 200
    solo = rank.sampler.generate(None, [kept])[0]
    assert kept_out.sequences[0].tokens == solo.sequences[0].tokens


def test_the_sampler_shares_the_base_weights_and_not_the_adapters(rank: Rank):
    """The embedded sampler's tree holds the trainer's base tensors themselves (no second copy
    of the model), and a sampler adapter never enters a training forward pass."""
    trained = dict(rank.trainer.model.adapters.lm.named_parameters())
    for name, p in rank.sampler.adapters.lm.named_parameters():
        if "lora" not in name:
            assert p is trained[name], name
    rank.trainer.create_adapter("shared", LoraSpec(rank=4, seed=9))
    probe = ForwardBackwardBatch([datum(4)], "cross_entropy", {}, True)
    before = rank.trainer.forward_backward("shared", probe).logprobs[0]
    config, weights = rank.trainer.zero_adapter()
    rank.sampler.load_sampler("zero", config, {k: torch.ones_like(v) for k, v in weights.items()})
    np.testing.assert_array_equal(before, rank.trainer.forward_backward("shared", probe).logprobs[0])
    rank.trainer.delete_adapter("shared")
