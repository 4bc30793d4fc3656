"""Dimuon through the real SDK: chosen at creation, shown by get_info and weights_info, stepped
with DimuonParams, refused with AdamParams (and the other way round), kept by full-state resume
(the next steps bit-identical), and replaced by a weights-only load's own choice."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(list(range(20 + i, 44 + i))),
        loss_fn_inputs={"target_tokens": list(range(21 + i, 45 + i)), "weights": [1.0] * 24},
    )
    for i in range(3)
]
DIMUON = types.DimuonParams(learning_rate=0.02, grad_clip_norm=50.0, beta1=0.8)


def train(tc, steps: int, params=DIMUON) -> list[tuple[float, list[np.ndarray], dict]]:
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(DATA, "cross_entropy")
        metrics = tc.optim_step(params).result().metrics
        result = fb.result()
        out.append((result.metrics["loss:sum"], [o["logprobs"].to_numpy() for o in result.loss_fn_outputs], metrics))
    return out


def assert_identical(a, b) -> None:
    for (loss_a, lps_a, _), (loss_b, lps_b, _) in zip(a, b, strict=True):
        assert loss_a == loss_b
        for x, y in zip(lps_a, lps_b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_dimuon_trains_and_is_shown(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(
            base_model=ALIAS, rank=8, seed=4, optimizer=types.DimuonOptimizerConfig()
        ).result()
        info = tc.get_info()
        assert info.optimizer_config.type == "dimuon" and info.optimizer_config.version == 1
        steps = train(tc, 8)
        losses = [loss for loss, _, _ in steps]
        assert losses[-1] < 0.8 * losses[0], losses
        assert [m["optimizer_step"] for _, _, m in steps] == list(range(1, 9))
        assert all(m["grad_norm"] > 0 and m["learning_rate"] == DIMUON.learning_rate for _, _, m in steps)
        path = tc.save_state("dimuon-info").result().path
        weights_info = tinker.RestClient(base_url=base_url).get_weights_info_by_tinker_path(path).result()
        assert weights_info.optimizer_config.type == "dimuon"
        adam = sc.create_lora_training_client(base_model=ALIAS, rank=8).result()
        assert adam.get_info().optimizer_config.type == "adamw"


def test_mixing_families_is_a_clear_400_and_the_model_trains_on(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(
            base_model=ALIAS, rank=4, seed=1, optimizer=types.DimuonOptimizerConfig()
        ).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match=r"created with the dimuon optimizer.*adamw"):
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        train(tc, 1)  # the refusal used up its seq_id; the gradients are still there
        adam = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        adam.forward_backward(DATA, "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match=r"created with the adamw optimizer.*AdamParams"):
            adam.optim_step(DIMUON).result()
        train(adam, 1, types.AdamParams(learning_rate=1e-3))


def test_full_state_resume_keeps_dimuon_bit_identically(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(
            base_model=ALIAS, rank=8, seed=2, optimizer=types.DimuonOptimizerConfig()
        ).result()
        train(tc, 2)
        path = tc.save_state("dimuon-resume").result().path
        uninterrupted = train(tc, 3)
    with tinker.ServiceClient(base_url=base_url) as fresh:
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.get_info().optimizer_config.type == "dimuon"
        assert_identical(train(resumed, 3), uninterrupted)
        # Weights only: the optimizer is the load's own choice (AdamW unless it names one), fresh.
        as_adam = fresh.create_training_client_from_state(path).result()
        assert as_adam.get_info().optimizer_config.type == "adamw"
        train(as_adam, 1, types.AdamParams(learning_rate=1e-3))
        fresh_dimuon = fresh.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()
        assert fresh_dimuon.get_info().optimizer_config.type == "dimuon"
        again = train(fresh_dimuon, 2)
        assert again[0][0] == uninterrupted[0][0]  # same weights
        assert again[1][0] != uninterrupted[1][0]  # but no momentum
        # Dimuon's state does not go into an AdamW model.
        adam = fresh.create_lora_training_client(base_model=ALIAS, rank=8).result()
        with pytest.raises(tinker.BadRequestError, match=r"holds dimuon optimizer state.*uses adamw"):
            adam.load_state_with_optimizer(path).result()


def test_bad_optimizer_configs_and_params_name_the_field(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        session_id = sc.holder.get_session_id()
        tc = sc.create_lora_training_client(
            base_model=ALIAS, rank=4, seed=3, optimizer=types.DimuonOptimizerConfig()
        ).result()
        model_id = tc.get_info().model_id
        with httpx.Client(base_url=base_url, timeout=60) as http:

            def create(config: dict) -> httpx.Response:
                body = {"session_id": session_id, "model_seq_id": 99, "base_model": ALIAS, "lora_config": {"rank": 4}}
                return http.post("/api/v1/create_model", json={**body, "optimizer_config": config})

            for config, needle in [
                ({"type": "lion"}, "optimizer_config.type 'lion'"),
                ({"type": "dimuon", "version": 2}, "optimizer_config.version = 2"),
                ({"type": "dimuon", "momentum": 0.9}, "optimizer_config.momentum"),
                ({"type": "adamw", "version": 1}, "optimizer_config.version"),
            ]:
                r = create(config)
                assert r.status_code == 400 and needle in r.json()["detail"], (config, r.text)
            for seq_id, params, needle in [
                (1, {"type": "dimuon"}, "optimizer_params.learning_rate: Field required"),
                (2, {"type": "dimuon", "learning_rate": -1.0}, "optimizer_params.learning_rate = -1.0"),
                (3, {"type": "dimuon", "learning_rate": 0.1, "beta1": 1.0}, "optimizer_params.beta1 = 1.0"),
                (4, {"type": "dimuon", "learning_rate": 0.1, "damping": 0.0}, "optimizer_params.damping = 0.0"),
                (5, {"type": "dimuon", "learning_rate": 0.1, "nesterov": True}, "optimizer_params.nesterov"),
                (6, {"type": "sgd", "learning_rate": 0.1}, "optimizer_params.type 'sgd'"),
                (7, {"type": "dimuon", "learning_rate": 0.1, "rank_lr_correction_exponent": 1e6}, "rank_lr_correction"),
            ]:
                r = http.post(
                    "/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id, "optimizer_params": params}
                )
                assert r.status_code == 400 and needle in r.json()["detail"], (params, r.text)
            ok = {"type": "dimuon", "learning_rate": 0.1, "damping": 0.5, "rank_lr_correction_exponent": 0.0}
            r = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 8, "optimizer_params": ok})
            assert r.status_code == 200, r.text
            result = http.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json()
            assert result["metrics"]["optimizer_step"] == 1.0, result  # the refusals before it used up 1..7
