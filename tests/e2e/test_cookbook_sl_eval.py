"""tinker-cookbook's ``sl_basic`` recipe evaluates test NLL through the server's sampler.

The recipe runs unmodified (``python -m tinker_cookbook.recipes.sl_basic``), as in
tests/e2e/test_cookbook_sl_basic.py, but with a test split (``dataset_builder.test_size``) and
``eval_every`` on. The test split makes ``supervised/train.py`` add a ``SamplerNLLEvaluator``.
Every ``eval_every`` steps it calls ``save_weights_and_get_sampling_client()`` and scores each
test conversation with ``SamplingClient.compute_logprobs`` (a ``sample`` request with
``max_tokens=1`` and ``include_prompt_logprobs=True``). The weighted mean NLL is logged as
``test/nll`` in metrics.jsonl, next to the step's training metrics.

The tokenizer for ``Qwen/Qwen3-8B-Base`` comes from a seeded offline HF cache that holds the
tiny model's tokenizer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.clients.cookbook import RECIPE_EXTRAS, offline_env, read_jsonl, require_cookbook, run_recipe
from tests.support.server import ALIAS, ServerProcess

tinker_cookbook = require_cookbook(*RECIPE_EXTRAS)

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
BATCH_SIZE = 8
TEST_SIZE = 8
EVAL_EVERY = 2
MAX_STEPS = 4
RUN_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sl_basic_eval_test_nll(server: ServerProcess, base_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    env = offline_env(tmp_path / "hf_home", tiny_model_dir, base_url)
    log_path = tmp_path / "sl_eval"  # fresh, so check_log_dir(..., "ask") does not prompt

    cmd = [
        "-m",
        "tinker_cookbook.recipes.sl_basic",
        f"model_name={ALIAS}",
        f"base_url={base_url}",
        f"log_path={log_path}",
        "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
        f"dataset_builder.file_path={CONVERSATIONS}",
        f"dataset_builder.test_size={TEST_SIZE}",  # a test split, so a SamplerNLLEvaluator
        f"dataset_builder.common_config.model_name_for_tokenizer={ALIAS}",
        "dataset_builder.common_config.renderer_name=role_colon",
        "dataset_builder.common_config.max_length=256",
        f"dataset_builder.common_config.batch_size={BATCH_SIZE}",
        "lora_rank=8",
        "learning_rate=1e-3",
        "save_every=0",
        f"eval_every={EVAL_EVERY}",
        f"max_steps={MAX_STEPS}",
    ]

    run_recipe("sl_basic", cmd, server=server, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT_S)

    metrics = read_jsonl(log_path / "metrics.jsonl")
    train_steps = [m["step"] for m in metrics if "train_mean_nll" in m]
    assert train_steps == list(range(MAX_STEPS)), metrics

    evals = {m["step"]: m["test/nll"] for m in metrics if "test/nll" in m}
    print("test/nll by step:", evals)
    # supervised/train evaluates before submitting step s when s % eval_every == 0.
    assert set(range(0, MAX_STEPS, EVAL_EVERY)) <= set(evals), metrics
    for step, nll in evals.items():
        # A random tiny model over a ~500-token vocabulary: NLL per token is well above 0.
        assert isinstance(nll, (int, float)) and math.isfinite(nll) and nll > 0, (step, nll)
