"""``save_weights_and_get_sampling_client(kind="inflight")`` through the real SDK: every inflight
client of a model samples its newest inflight weights; snapshot clients keep theirs."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess
from tests.support.training import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = types.ModelInput.from_ints(list(range(40, 60)))


def scores(client) -> np.ndarray:
    """The client's log-probs of PROMPT: which weights it samples, to float precision."""
    return np.array(client.compute_logprobs(PROMPT).result()[1:], dtype=np.float64)


def test_inflight_clients_follow_the_newest_inflight_save(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=6).result()
        train(tc, 1)
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        frozen = tc.save_weights_and_get_sampling_client().result()  # a snapshot of the same weights
        w1 = scores(frozen)
        np.testing.assert_array_equal(scores(first), w1)

        train(tc, 3)
        second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        w2 = scores(second)
        assert np.abs(w2 - w1).max() > 1e-3  # training moved the weights
        np.testing.assert_array_equal(scores(first), w2)  # the older inflight client adopted them
        np.testing.assert_array_equal(scores(frozen), w1)  # the snapshot did not

        # more inflight saves than the snapshots kept per model: the first client still works
        for _ in range(9):
            train(tc, 1)
            last = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        np.testing.assert_array_equal(scores(first), scores(last))
        out = first.sample(PROMPT, 2, types.SamplingParams(max_tokens=4, seed=1)).result()
        assert len(out.sequences) == 2
