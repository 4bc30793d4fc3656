"""``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` through the real SDK, checked against
the server's own prompt log-probs and top-k rows (themselves checked against the trainer)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.server import ALIAS, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = [30, 41, 17, 99, 250, 3, 77, 77, 120, 301, 5, 64, 11]
ONE = types.SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def sampler(server: ServerProcess):
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        yield sc.create_sampling_client(base_model=ALIAS).result()


def test_target_prompt_logprobs_dense_and_sparse(sampler) -> None:
    prompt = types.ModelInput.from_ints(TOKENS)
    n = len(TOKENS)
    ref = sampler.sample(prompt, 1, ONE, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    # column 0: the prompt's own next token; columns 1-2: the top-2 alternatives; one cell unasked
    ids = torch.full((n - 1, 3), -1, dtype=torch.int64)
    for i in range(n - 1):
        ids[i, 0] = TOKENS[i + 1]
        ids[i, 1:] = torch.tensor([t for t, _ in ref.topk_prompt_logprobs[i + 1][:2]])
    ids[4, 2] = -1
    dense = sampler.sample(prompt, 1, ONE, target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    got = dense.target_prompt_logprobs.to_torch().numpy()
    assert got.shape == (n - 1, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0], ref.prompt_logprobs[1:], atol=1e-6)
    top = np.array([[lp for _, lp in ref.topk_prompt_logprobs[i + 1][:2]] for i in range(n - 1)])
    expected_top = top.copy()
    expected_top[4, 1] = 0.0  # the -1 cell
    np.testing.assert_allclose(got[:, 1:], expected_top, atol=1e-6)

    # sparse in, sparse out: only the named cells travel, with the same values
    few = torch.full((n - 1, 3), -1, dtype=torch.int64)
    few[n - 2, 0], few[2, 1] = TOKENS[-1], int(ids[2, 1])
    sparse = types.TensorData.from_torch_sparse(few, pad_value=-1)
    out = sampler.sample(prompt, 1, ONE, target_prompt_logprobs=sparse).result().target_prompt_logprobs
    assert out.sparse_crow_indices == sparse.sparse_crow_indices and out.sparse_col_indices == sparse.sparse_col_indices
    np.testing.assert_allclose(out.data, [got[2, 1], got[n - 2, 0]], atol=1e-6)

    for bad, match in [
        (torch.full((n - 2, 1), 5, dtype=torch.int64), r"expected \[12, K\]"),
        (torch.full((n - 1, 1), -1, dtype=torch.int64), "names no token id"),
        (torch.full((n - 1, 1), 10**7, dtype=torch.int64), "token id 10000000"),
    ]:
        with pytest.raises(tinker.BadRequestError, match=match):
            sampler.sample(prompt, 1, ONE, target_prompt_logprobs=types.TensorData.from_torch(bad)).result()


def test_prompt_alt_tokens_are_seeded_draws_from_the_model(sampler) -> None:
    prompt = types.ModelInput.from_ints(TOKENS)
    n = len(TOKENS)
    ref = sampler.sample(prompt, 1, ONE, topk_prompt_logprobs=1).result()
    greedy = sampler.sample(prompt, 1, ONE, prompt_alt_tokens_k=2).result().prompt_alt_tokens
    tokens, logprobs = greedy.tokens.to_torch().numpy(), greedy.logprobs.to_torch().numpy()
    assert tokens.shape == logprobs.shape == (n - 1, 2)
    best = np.array([ref.topk_prompt_logprobs[i + 1][0] for i in range(n - 1)])
    np.testing.assert_array_equal(tokens, np.repeat(best[:, :1].astype(np.int64), 2, axis=1))  # T=0: argmax
    np.testing.assert_allclose(logprobs[:, 0], best[:, 1], atol=1e-6)

    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=11)
    a = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=8).result().prompt_alt_tokens
    b = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=8).result().prompt_alt_tokens
    np.testing.assert_array_equal(a.tokens.to_torch().numpy(), b.tokens.to_torch().numpy())  # same seed
    drawn = a.tokens.to_torch().numpy()
    assert len(np.unique(drawn)) > n  # real draws, not one token per row
    assert np.all(a.logprobs.to_torch().numpy() <= 0)
    # the log-prob of a drawn token is the model's: score the first rows' draws as targets
    # (at most 64 distinct ids per request) and compare
    asked = drawn.copy()
    asked[6:] = -1
    target = types.TensorData.from_torch(torch.from_numpy(asked))
    got = sampler.sample(prompt, 1, ONE, target_prompt_logprobs=target).result().target_prompt_logprobs
    np.testing.assert_allclose(got.to_torch().numpy()[:6], a.logprobs.to_torch().numpy()[:6], atol=1e-6)
