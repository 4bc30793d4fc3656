"""Server-side custom losses through the real SDK: ``create_custom_loss`` uploads the traced loss
(the server advertises ``custom_loss_server_side``), ``forward_backward_custom`` runs it here in
one pass. A custom cross-entropy trains exactly as the built-in one; metrics reduce as the SDK
says; another session's loss is unknown; forbidden graphs are refused naming the node."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.custom_losses import DATA, evil_writer, masked_copies, views_everywhere
from tests.support.server import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SFT = [  # the same datums, as the built-in cross_entropy takes them
    types.Datum(
        model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")}
    )
    for d in DATA
]


def custom_ce(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/tokens:mean": (weights > 0).sum()}


def pg(logprobs, advantages):
    return -(logprobs * advantages).sum(), {"custom/adv:mean": advantages.mean()}


def test_a_custom_cross_entropy_trains_exactly_as_the_builtin(base_url):
    adam = types.AdamParams(learning_rate=1e-2)
    with tinker.ServiceClient(base_url=base_url) as sc:
        handle = sc.create_custom_loss(custom_ce, input_ranks={"logprobs": 1, "weights": 1}).result()
        assert handle.loss_id is not None  # uploaded: it runs on the server
        custom = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=11).result()
        builtin = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=11).result()
        for _ in range(3):
            got = custom.forward_backward_custom(DATA, handle).result()
            want = builtin.forward_backward(SFT, "cross_entropy").result()
            assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
            assert got.metrics["custom/nll:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
            assert got.metrics["custom/tokens:mean"] == pytest.approx(20.0)  # a mean over the 3 datums
            for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].to_numpy(), rtol=1e-6)
            custom.optim_step(adam).result(), builtin.optim_step(adam).result()
        # The policy-gradient loss reads another input; loss:sum is its value.
        result = custom.forward_backward_custom(
            DATA, sc.create_custom_loss(pg, {"logprobs": 1, "advantages": 1}).result()
        )
        lps = [o["logprobs"].to_numpy().astype(np.float64) for o in result.result().loss_fn_outputs]
        expected = -sum(lp.sum() * 0.25 * (i + 1) for i, lp in enumerate(lps))
        metrics = result.result().metrics
        assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert metrics["custom/adv:mean"] == pytest.approx(0.5)


def test_a_loss_belongs_to_its_session_and_bad_graphs_name_the_node(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc, tinker.ServiceClient(base_url=base_url) as other:
        handle = sc.create_custom_loss(custom_ce, input_ranks={"logprobs": 1, "weights": 1}).result()
        tc = other.create_lora_training_client(base_model=ALIAS, rank=4).result()
        with pytest.raises(tinker.NotFoundError, match="loss_id"):
            tc.forward_backward(DATA, "custom", {"loss_id": handle.loss_id}).result()
        mine = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        missing = [types.Datum(model_input=DATA[0].model_input, loss_fn_inputs={"target_tokens": list(range(21, 41))})]
        with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.weights is required"):
            mine.forward_backward(missing, "custom", {"loss_id": handle.loss_id}).result()
        mine.forward_backward_custom(DATA, handle).result()  # the refusals used up their seq_ids
        session_id = sc.holder.get_session_id()
        with httpx.Client(base_url=base_url, timeout=30) as http:
            body = {
                "session_id": session_id,
                "custom_loss_seq_id": 99,
                "name": "sneaky",
                "inputs": [{"name": "logprobs", "rank": 1}],
                "graph": {
                    "nodes": [
                        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                        {"op": "call_function", "name": "boom", "target": "os.system", "args": ["true"]},
                        {"op": "output", "name": "output", "target": "output", "args": [{"ref": "boom"}]},
                    ]
                },
            }
            r = http.post("/api/v1/create_custom_loss", json=body)
            assert r.status_code == 400 and "graph.nodes[1] (boom): calling 'os.system' is not allowed" in r.text


def test_a_loss_survives_a_restart(tmp_path, tiny_model_dir):
    from tests.support.server import start_server

    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        with tinker.ServiceClient(base_url=server.base_url) as sc:
            handle = sc.create_custom_loss(custom_ce, input_ranks={"logprobs": 1, "weights": 1}).result()
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
            before = tc.forward_backward_custom(DATA, handle).result().metrics["loss:sum"]
            path = tc.save_state("custom").result().path
            port = int(server.base_url.rsplit(":", 1)[1])
            server.stop()
            server = start_server(tmp_path, "--model", str(tiny_model_dir), port=port)
            resumed = sc.create_training_client_from_state(path).result()
            after = resumed.forward_backward_custom(DATA, handle).result().metrics["loss:sum"]
            assert after == pytest.approx(before, rel=1e-6)
            assert torch.isfinite(torch.tensor(after))
    finally:
        server.stop()


# ---- one tenant's loss against another's pass (an attacker's audit) ---------------------------


def _blocked(base_url: str, sc: tinker.ServiceClient):
    """A long request of a third model that holds the dispatch thread while what is sent next
    queues up behind it (and so runs as one joint pass); its future."""
    from tests.support.metrics import scrape
    from tests.support.training import datums

    blocker = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
    busy = blocker.forward_backward(datums(7, 48, 400), "cross_entropy")
    deadline = time.monotonic() + 30
    while scrape(base_url)[("hosted_tinker_in_flight", ())] < 1:
        assert time.monotonic() < deadline, "the blocker never reached the dispatch thread"
    return busy


def test_a_tenants_loss_cannot_write_into_anothers_pass(base_url):
    """The attacker's writing loss is refused when made (a 400 naming the node). Its strongest
    allowed loss, run in one joint pass with a victim's cross-entropy, leaves the victim's loss
    and log-probs exactly what they are when it runs alone."""
    from tests.support.metrics import moved, scrape

    with tinker.ServiceClient(base_url=base_url) as attacker, tinker.ServiceClient(base_url=base_url) as victim:
        with pytest.raises(tinker.BadRequestError, match=r"\(mul\): out= is not allowed"):
            attacker.create_custom_loss(evil_writer, input_ranks={"logprobs": 1}).result()
        peek = attacker.create_custom_loss(views_everywhere, input_ranks={"logprobs": 1, "weights": 1}).result()
        hostile = attacker.create_lora_training_client(base_model=ALIAS, rank=4).result()
        alone = victim.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        joint = victim.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        want = alone.forward_backward(SFT, "cross_entropy").result()

        before = scrape(base_url)
        busy = _blocked(base_url, attacker)
        attack = hostile.forward_backward_custom(DATA, peek)
        got = joint.forward_backward(SFT, "cross_entropy").result()
        attack.result(), busy.result()
        assert moved(before, scrape(base_url), "hosted_tinker_joint_pass_joined_total") >= 1
        assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
        for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())


def test_a_boolean_mask_loss_is_held_to_its_bound_and_the_worker_serves_on(base_url):
    """Ten mask selections of a 4,096-token datum's 2 MiB double value pass what its pass may
    hold (8 MiB): the request fails as the loss's own error, charged before the selection ran,
    and the worker serves another client's step at once."""
    long_datum = types.Datum(
        model_input=types.ModelInput.from_ints([7] * 4096), loss_fn_inputs={"target_tokens": [8] * 4096}
    )
    with tinker.ServiceClient(base_url=base_url) as attacker, tinker.ServiceClient(base_url=base_url) as other:
        handle = attacker.create_custom_loss(masked_copies, input_ranks={"logprobs": 1}).result()
        tc = attacker.create_lora_training_client(base_model=ALIAS, rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match=r"over their bound of 8388608 bytes in all") as failure:
            tc.forward_backward_custom([long_datum], handle).result()
        assert str(failure.value.category).lower().endswith("user")
        victim = other.create_lora_training_client(base_model=ALIAS, rank=4).result()
        assert victim.forward_backward(SFT, "cross_entropy").result().metrics["loss:sum"] > 0
