"""tinker-cookbook's ``sl_basic`` recipe saves periodic checkpoints and resumes from them.

The recipe runs unmodified (``python -m tinker_cookbook.recipes.sl_basic``) against the real
server. The only changes are on its command line: the HF dataset is swapped for the wheel's
``example_data/conversations.jsonl`` (``FromConversationFileBuilder``), and evaluation is off
(``eval_every=0``, no test split), because evaluation samples and this server does not sample
yet. The tokenizer for ``Qwen/Qwen3-8B-Base`` comes from a seeded offline HF cache that holds
the tiny model's tokenizer.

Run 1 trains 4 steps with ``save_every=2``. It writes the periodic checkpoint ``000002`` and then
``final`` to ``checkpoints.jsonl``.

A run whose last record is ``final`` counts as finished: rerunning it only logs "Training was
already complete". So the test simulates a preemption: it drops the ``final`` record, which
leaves the file as it would be if the process had died after its last periodic save.

Run 2 uses the same ``log_path`` with ``max_steps=6``. It must resume, through
``create_training_client_from_state_with_optimizer``. That call is a create-via-load
``load_weights`` on the server, and it restores the saved weights and the Adam state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.clients.cookbook import RECIPE_EXTRAS, offline_env, read_jsonl, require_cookbook, run_recipe
from tests.support.server import ALIAS, ServerProcess

tinker_cookbook = require_cookbook(*RECIPE_EXTRAS)

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
BATCH_SIZE = 8
LEARNING_RATE = 1e-3
SAVE_EVERY = 2
RUN1_STEPS = 4
RUN2_STEPS = 6
RUN_TIMEOUT_S = 240


def linear_lr(step: int, total_steps: int) -> float:
    return LEARNING_RATE * (1 - step / total_steps)


def run_id_of(tinker_path: str) -> str:
    # tinker://<run_id>/<kind>/<name>
    return tinker_path.removeprefix("tinker://").split("/")[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sl_basic_checkpoints_and_resume(
    server: ServerProcess, base_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import tinker

    env = offline_env(tmp_path / "hf_home", tiny_model_dir, base_url)
    log_path = tmp_path / "sl_basic"

    def sl_basic(max_steps: int, stdin: str) -> str:
        cmd = [
            "-m",
            "tinker_cookbook.recipes.sl_basic",
            f"model_name={ALIAS}",
            f"base_url={base_url}",
            f"log_path={log_path}",
            "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
            f"dataset_builder.file_path={CONVERSATIONS}",
            "dataset_builder.test_size=0",  # no test split, so no sampling evaluator
            f"dataset_builder.common_config.model_name_for_tokenizer={ALIAS}",
            "dataset_builder.common_config.renderer_name=role_colon",
            "dataset_builder.common_config.max_length=256",
            f"dataset_builder.common_config.batch_size={BATCH_SIZE}",
            "lora_rank=8",
            f"learning_rate={LEARNING_RATE}",
            f"save_every={SAVE_EVERY}",
            "eval_every=0",
            f"max_steps={max_steps}",
        ]
        return run_recipe(
            f"sl_basic max_steps={max_steps}",
            cmd,
            server=server,
            env=env,
            cwd=tmp_path,
            timeout=RUN_TIMEOUT_S,
            stdin=stdin,
        )

    # ---- Run 1: fresh log dir, 4 steps, a periodic checkpoint at step 2, then `final`.
    # stdin is empty, so an unexpected "log dir exists" prompt fails with EOFError and does not hang.
    sl_basic(RUN1_STEPS, stdin="")

    records1 = read_jsonl(log_path / "checkpoints.jsonl")
    assert [r["name"] for r in records1] == ["000002", "final"], records1
    for r in records1:
        assert r["state_path"].startswith("tinker://") and "/weights/" in r["state_path"], r
        assert r["sampler_path"].startswith("tinker://") and "/sampler_weights/" in r["sampler_path"], r
    run1_id = run_id_of(records1[0]["state_path"])
    assert {run_id_of(r[k]) for r in records1 for k in ("state_path", "sampler_path")} == {run1_id}
    assert (records1[0]["epoch"], records1[0]["batch"]) == (0, SAVE_EVERY)

    metrics1 = read_jsonl(log_path / "metrics.jsonl")
    assert [m["step"] for m in metrics1] == list(range(RUN1_STEPS))
    assert [m["optimizer_step"] for m in metrics1] == [float(i + 1) for i in range(RUN1_STEPS)]
    for m in metrics1:
        assert m["learning_rate"] == pytest.approx(linear_lr(m["step"], RUN1_STEPS))

    rest = tinker.RestClient(base_url=base_url)
    listed = {c.tinker_path for c in rest.list_checkpoints(run1_id).result().checkpoints}
    assert {r[k] for r in records1 for k in ("state_path", "sampler_path")} <= listed, listed
    run1 = rest.get_training_run_by_tinker_path(records1[0]["state_path"]).result()
    assert (run1.training_run_id, run1.base_model, run1.lora_rank) == (run1_id, ALIAS, 8)
    assert (run1.user_metadata or {}).get("renderer_name") == "role_colon"

    # ---- Preemption: the process "died" after the step-2 save, before the final one.
    (log_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records1 if r["name"] != "final"))
    resume_from = records1[0]
    resume_step = resume_from["batch"]  # epoch 0 (one epoch has 128 // 8 = 16 batches)

    # ---- Run 2: same log_path, more steps. check_log_dir(..., "ask") reads the answer from stdin.
    out2 = sl_basic(RUN2_STEPS, stdin="resume\n")
    assert "Training was already complete" not in out2, out2[-4000:]
    assert f"Resumed training from {resume_from['state_path']}" in out2, out2[-4000:]
    assert f"Resuming at step {resume_step}: dropped {RUN1_STEPS - resume_step} metrics rows" in out2, out2[-4000:]

    records = read_jsonl(log_path / "checkpoints.jsonl")
    assert records[0] == resume_from
    records2 = records[1:]
    assert [r["name"] for r in records2] == ["000002", "000004", "final"], records2
    for r in records2:
        assert r["state_path"].startswith("tinker://") and "/weights/" in r["state_path"], r
    run2_id = run_id_of(records2[0]["state_path"])
    assert run2_id != run1_id
    assert {run_id_of(r["state_path"]) for r in records2} == {run2_id}
    # The SDK logs this once the create-via-load load_weights future has resolved.
    assert f"TrainingClient initialized for model {run2_id} via load_weights" in out2, out2[-4000:]

    run2 = rest.get_training_run_by_tinker_path(records2[-1]["state_path"]).result()
    assert (run2.training_run_id, run2.base_model, run2.lora_rank) == (run2_id, ALIAS, 8)
    assert (run2.user_metadata or {}).get("renderer_name") == "role_colon"

    # metrics.jsonl: run 1's rows before the resume step are kept, and run 2 continues from there
    # (its rows follow run 2's 6-step LR schedule; run 1's rows >= resume_step were dropped).
    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(RUN2_STEPS))
    assert metrics[:resume_step] == metrics1[:resume_step]
    resumed = metrics[resume_step:]
    for m in resumed:
        assert m["learning_rate"] == pytest.approx(linear_lr(m["step"], RUN2_STEPS))
        assert m["num_sequences"] == BATCH_SIZE
    assert resumed[0]["tokens/cumulative/trained"] == resume_from["elapsed_tokens"] + resumed[0]["num_tokens"]

    # The Adam state was restored: a fresh optimizer would report optimizer_step 1.0 here.
    # (With the cookbook's submit_ahead=1 the step-2 save is queued after step 3's optim_step,
    # so the checkpoint holds 4 optimizer steps.)
    opt_steps = [m["optimizer_step"] for m in resumed]
    assert opt_steps[0] > resume_step, opt_steps
    assert opt_steps == [opt_steps[0] + i for i in range(len(resumed))], opt_steps
    # So were the weights: on the same batch, the restored model beats run 1's model at that step
    # (which had taken only resume_step optimizer steps).
    assert resumed[0]["train_mean_nll"] < metrics1[resume_step]["train_mean_nll"], (resumed[0], metrics1)
