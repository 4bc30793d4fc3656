"""End-to-end: sampling with ``record_stability_info``, provenance spans, and ``stable_reinforce``,
through the real SDK on a live server.

The datums are built as tinker-cookbook's ``rl_loop`` builds them (``with_sampled_provenance``):
input = prompt + sampled[:-1], targets = placeholders on the prompt + the sampled tokens. The
loss the server reports is checked against a float64 evaluation of the formula in docs/compatibility.md on
the learner log-probs it returned and the sampler log-probs the client saw.
"""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support import sdk
from tests.support.loss_reference import ref_stable_reinforce
from tests.support.server import ALIAS, ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = list(range(30, 42))
PARAMS = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])
ADVANTAGES = [1.0, -0.5, 0.75, -1.0]


def rl_datum(seq: types.SampledSequence, advantage: float, prompt=PROMPT, logprobs=None) -> types.Datum:
    return sdk.rl_datum(seq, advantage, prompt, logprobs)


def reference_loss(seqs, advantages, learner, c=2.0, beta=0.0) -> tuple[float, list[np.ndarray]]:
    """test_losses' float64 reference on the learner log-probs the server returned and the sampler
    log-probs the client saw; prompt positions (the first len(PROMPT) - 1) are not sampled."""
    total, per_datum = 0.0, []
    for seq, adv, lp in zip(seqs, advantages, learner, strict=True):
        n_prompt = len(PROMPT) - 1
        q = np.concatenate([np.zeros(n_prompt), np.asarray(seq.logprobs, dtype=np.float64)])
        sampled = np.concatenate([np.zeros(n_prompt), np.ones(len(seq.logprobs))])
        terms, _ = ref_stable_reinforce(np.asarray(lp, dtype=np.float64), q, np.full(len(q), adv), sampled, c, beta)
        per_datum.append(terms)
        total += terms.sum()
    return total, per_datum


def outputs(fb, key: str) -> list[np.ndarray]:
    return [np.asarray(out[key].tolist(), dtype=np.float64) for out in fb.loss_fn_outputs]


@pytest.fixture(scope="module")
def clients(server: ServerProcess):
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=3).result()
        yield sc, tc


def test_recorded_samples_train_with_stable_reinforce(clients) -> None:
    _, tc = clients
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, PARAMS).result().sequences
    assert len({s.sequence_id for s in seqs}) == 4 and all(s.logprobs for s in seqs)
    data = [rl_datum(s, a) for s, a in zip(seqs, ADVANTAGES, strict=True)]

    fb = tc.forward_backward(data, "stable_reinforce").result()
    learner = outputs(fb, "logprobs")
    want, want_terms = reference_loss(seqs, ADVANTAGES, learner)
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    # elementwise_loss: the per-token terms of that sum, zero on the prompt positions
    for got, ref in zip(outputs(fb, "elementwise_loss"), want_terms, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # Sampler and trainer hold the same weights: their log-probs agree on the sampled tokens.
    assert fb.metrics["sampler_logprob_gap:max"] < 1e-3
    assert 0 <= fb.metrics["sampler_logprob_gap:mean"] <= fb.metrics["sampler_logprob_gap:max"]

    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    # Off-policy now (the learner moved, the record did not): the ratio and the KL term count.
    cfg = {"kl_coeff": 0.5, "clip_high_threshold": 1.05}
    after = tc.forward(data, "stable_reinforce", loss_fn_config=cfg).result()
    learner = outputs(after, "logprobs")
    want, _ = reference_loss(seqs, ADVANTAGES, learner, c=1.05, beta=0.5)
    assert after.metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert after.metrics["sampler_logprob_gap:max"] > 1e-3
    # the same data as importance_sampling (the client's logprobs) reports the same gap
    data_is = [rl_datum(s, a) for s, a in zip(seqs, ADVANTAGES, strict=True)]
    is_fb = tc.forward(data_is, "importance_sampling").result()
    assert is_fb.metrics["sampler_logprob_gap:max"] == pytest.approx(after.metrics["sampler_logprob_gap:max"])


def test_provenance_that_does_not_match_the_record_is_refused(clients, server: ServerProcess) -> None:
    sc, tc = clients
    recording = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = recording.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
    plain = sc.create_sampling_client(base_model=ALIAS).result()
    unrecorded = plain.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]

    def refused(datum: types.Datum, match: str, loss_fn: str = "stable_reinforce") -> None:
        with pytest.raises(tinker.BadRequestError, match=match):
            tc.forward([datum], loss_fn).result()

    good = rl_datum(seq, 1.0)
    # no provenance at all
    refused(
        types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs), r"data\[0\] has no provenance"
    )
    # a sequence that was sampled without record_stability_info (or never)
    refused(rl_datum(unrecorded, 1.0), "has no record in this session")
    # the input is not what the sampler saw
    tokens = PROMPT.copy()
    tokens[3] += 1
    refused(rl_datum(seq, 1.0, prompt=tokens), r"model_input_spans\[0\]: position 3 holds token 34")
    # a span past the end of the sampled tokens
    sid, n = seq.sequence_id, len(seq.tokens)
    too_long = good.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, offset=2, length=n - 1),
        ],
        loss_fn_inputs=good.loss_fn_input_spans,
    )
    refused(too_long, r"positions \[2, 9\) are outside the sampled tokens")
    # the client's copy of the sampler's log-probs differs from the record
    lps = list(seq.logprobs)
    lps[2] -= 0.5
    refused(rl_datum(seq, 1.0, logprobs=lps), r"loss_fn_inputs.logprobs\[13\] = .* but the sampler recorded")
    # spans are checked against the record for every loss, not only the one that reads it ...
    refused(rl_datum(seq, 1.0, prompt=tokens), r"position 3 holds token 34", loss_fn="importance_sampling")
    # ... but only that one needs a record: the cookbook labels every RL datum, recorded or not
    assert tc.forward([rl_datum(unrecorded, 1.0)], "importance_sampling").result().metrics["loss:sum"] != 0
    # another session cannot use this session's records
    with tinker.ServiceClient(base_url=server.base_url) as other:
        tc2 = other.create_lora_training_client(base_model=ALIAS, rank=8).result()
        with pytest.raises(tinker.BadRequestError, match="has no record in this session"):
            tc2.forward([good], "stable_reinforce").result()
    # and the model keeps serving
    assert tc.forward([good], "stable_reinforce").result().metrics["loss:sum"] != 0


def test_records_survive_a_restart(tmp_path, tiny_model_dir) -> None:
    servers = [start_server(tmp_path, "--model", str(tiny_model_dir))]
    port = int(servers[0].base_url.rsplit(":", 1)[1])
    try:
        with tinker.ServiceClient(base_url=servers[0].base_url) as sc:
            sampler = sc.create_sampling_client(base_model=ALIAS, record_stability_info=True).result()
            seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result().sequences
            servers[0].stop(signal.SIGKILL)
            servers.append(start_server(tmp_path, "--model", str(tiny_model_dir), port=port))
            assert httpx.get(f"{servers[1].base_url}/healthz").json()["status"] == "ok"
            # The same SDK session goes on: a new model in it trains on the sequences sampled before.
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=1).result()
            fb = tc.forward_backward([rl_datum(s, 1.0) for s in seqs], "stable_reinforce").result()
            want, _ = reference_loss(seqs, [1.0, 1.0], outputs(fb, "logprobs"))
            assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    finally:
        for srv in servers:
            srv.stop()
