"""tinker-cookbook's ``rl_basic`` recipe runs against the real server, and sampler and trainer agree.

The recipe runs unmodified (``python -m tinker_cookbook.recipes.rl_basic``). The only change is
on its command line: the HF GSM8K dataset is swapped for the synthetic
``ArithmeticDatasetBuilder`` (reference/clients.md §1.3). The tokenizer for
``Qwen/Qwen3-8B-Base`` comes from a seeded offline HF cache that holds the tiny model's tokenizer.

Each of the 6 steps samples 4 groups x 4 rollouts through ``SamplingClient.sample`` (one request
per rollout), then trains on them with ``forward_backward(loss_fn="importance_sampling")``. The
recipe compares the sampler's per-token logprobs with the trainer's logprobs for the same tokens
under the same weights, and logs the mean difference as ``optim/kl_sample_train_v1``. It is only
near zero when the sampler serves exactly the weights the trainer holds, with the same numerics.

The random tiny model never answers in the expected format, so every rollout gets the same reward
(-0.1), every advantage is zero and the recipe's own updates leave the adapter where it started. A
fresh LoRA adapter starts as a zero delta, so the KL alone would only compare sampler and trainer
on the base weights. The test therefore first trains a rank-8 adapter for a few cross-entropy steps
through the SDK and starts the recipe from it (``load_checkpoint_path``, weights only). A sampler
that dropped the adapter would then be far off: sampling 16 tokens from the base model and scoring
them with this adapter's trainer gives a kl_sample_train_v1 of about 6, against ~1e-7 when the
sampler serves the adapter.

The recipe's rollouts need its math-rl extras (``pylatexenc``, ``math-verify``; ``sympy`` comes with
torch): ``rl_basic`` imports the GSM8K builder's grading module even when the builder is swapped.

``save_every=2``: after steps 1, 3 and 5 the recipe saves a periodic checkpoint (``000002``,
``000004``, ``000006``: ``save_state`` + ``save_weights_for_sampler``) and opens the next sampler
with ``create_sampling_client(sampler_path)``; after the other steps it uses
``save_weights_and_get_sampling_client()``. So steps 2 and 4 roll out from a sampler loaded by path,
and their KL checks that path too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.clients.cookbook import (
    MATH_RL_EXTRAS,
    RECIPE_EXTRAS,
    offline_env,
    read_jsonl,
    require_cookbook,
    run_recipe,
)
from tests.support.server import ALIAS, ServerProcess

require_cookbook(*RECIPE_EXTRAS, *MATH_RL_EXTRAS)  # the recipe runs in a subprocess

N_BATCHES = 6
BATCH_SIZE = 4
GROUP_SIZE = 4
SAVE_EVERY = 2
LORA_RANK = 8
PRETRAIN_STEPS = 10
PRETRAIN_LR = 1e-2
KL_TOLERANCE = 1e-3
RUN_TIMEOUT_S = 300


def pretrain_adapter(base_url: str, model_dir: Path) -> str:
    """Train a rank-LORA_RANK adapter on arithmetic chats; return its ``tinker://.../weights/...`` path."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # The role_colon rendering of the arithmetic env's conversations.
    texts = [f"User: What is {a} + {b}?\n\nAssistant: {a + b}\n\n" for a, b in ((3, 4), (12, 30), (25, 17), (8, 61))]
    data = []
    for t in texts:
        ids = tok.encode(t)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    sc = tinker.ServiceClient(base_url=base_url)
    try:
        tc = sc.create_lora_training_client(
            base_model=ALIAS, rank=LORA_RANK, seed=0, user_metadata={"renderer_name": "role_colon"}
        ).result()
        nlls = []
        for _ in range(PRETRAIN_STEPS):
            fwd = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=PRETRAIN_LR)).result()
            logprobs = [lp for out in fwd.result().loss_fn_outputs for lp in out["logprobs"].tolist()]
            nlls.append(-sum(logprobs) / len(logprobs))
        # The adapter really moved the model: it is far from a zero delta.
        assert nlls[-1] < 0.5 * nlls[0], nlls
        return tc.save_state("pretrained").result().path
    finally:
        sc.close("success").result()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rl_basic_sampler_matches_trainer(
    server: ServerProcess, base_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = offline_env(tmp_path / "hf_home", tiny_model_dir, base_url)
    log_path = tmp_path / "rl_basic"  # fresh, so check_log_dir(..., "ask") does not prompt
    pretrained = pretrain_adapter(base_url, tiny_model_dir)

    cmd = [
        "-m",
        "tinker_cookbook.recipes.rl_basic",
        f"model_name={ALIAS}",
        f"base_url={base_url}",
        f"log_path={log_path}",
        "dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder",
        f"dataset_builder.batch_size={BATCH_SIZE}",
        f"dataset_builder.group_size={GROUP_SIZE}",
        f"dataset_builder.n_batches={N_BATCHES}",
        f"dataset_builder.model_name_for_tokenizer={ALIAS}",
        "dataset_builder.renderer_name=role_colon",
        "max_tokens=16",
        f"lora_rank={LORA_RANK}",
        f"load_checkpoint_path={pretrained}",
        f"save_every={SAVE_EVERY}",
    ]

    out = run_recipe("rl_basic", cmd, server=server, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT_S)
    assert f"Loaded weights from {pretrained}" in out, out[-4000:]

    metrics = read_jsonl(log_path / "metrics.jsonl")
    steps = [m for m in metrics if "optim/kl_sample_train_v1" in m]
    assert [m["step"] for m in steps] == list(range(N_BATCHES)), metrics

    kls = [m["optim/kl_sample_train_v1"] for m in steps]
    print("optim/kl_sample_train_v1 per step:", kls)
    print("optim/kl_sample_train_v2 per step:", [m.get("optim/kl_sample_train_v2") for m in steps])
    for m in steps:
        kl = m["optim/kl_sample_train_v1"]
        assert isinstance(kl, (int, float)) and math.isfinite(kl), m
        assert abs(kl) < KL_TOLERANCE, f"step {m['step']}: sampler and trainer logprobs disagree: {kls}"
        # The rollouts really were sampled and scored: a nonzero sampling entropy estimate.
        assert math.isfinite(m["optim/entropy"]) and m["optim/entropy"] > 0, m

    # Periodic saves (both kinds) every SAVE_EVERY batches, then `final`.
    records = read_jsonl(log_path / "checkpoints.jsonl")
    periodic = list(range(SAVE_EVERY, N_BATCHES + 1, SAVE_EVERY))
    assert [r["name"] for r in records] == [f"{b:06d}" for b in periodic] + ["final"], records
    assert [r["batch"] for r in records[:-1]] == periodic, records
    for r in records:
        assert r["state_path"].startswith("tinker://") and "/weights/" in r["state_path"], r
        assert r["sampler_path"].startswith("tinker://") and "/sampler_weights/" in r["sampler_path"], r
