"""End-to-end: the unmodified `tinker` CLI (checkpoint list / download / delete) against a live server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.support.cli import (
    CLI_TIMEOUT,  # noqa: F401
    run_cli,  # noqa: F401
)
from tests.support.server import ALIAS


def cli_json(base_url: str, *args: str, cwd: Path) -> dict:
    proc = run_cli(base_url, *args, cwd=cwd)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"non-JSON output from {args}:\n{proc.stdout}\nstderr:\n{proc.stderr}") from e


def list_paths(base_url: str, run_id: str, cwd: Path) -> dict[str, dict]:
    out = cli_json(base_url, "checkpoint", "list", "--run-id", run_id, cwd=cwd)
    assert out["run_id"] == run_id
    return {c["tinker_path"]: c for c in out["checkpoints"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_list_download_delete(base_url: str, tmp_path: Path):
    from safetensors.torch import load_file

    # --- Produce a training checkpoint and a sampler checkpoint with the SDK.
    with tinker.ServiceClient(base_url=base_url) as service_client:
        tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
        )
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert fb.result().metrics["loss:sum"] > 0
        state_path = tc.save_state("cli-a").result().path
        sampler_path = tc.save_weights_for_sampler("cli-s").result().path

    parsed_state = tinker.ParsedCheckpointTinkerPath.from_tinker_path(state_path)
    parsed_sampler = tinker.ParsedCheckpointTinkerPath.from_tinker_path(sampler_path)
    run_id = parsed_state.training_run_id
    assert parsed_sampler.training_run_id == run_id
    assert parsed_state.checkpoint_type == "training"
    assert parsed_sampler.checkpoint_type == "sampler"

    # --- `tinker checkpoint list --run-id`: both checkpoints, JSON and table formats.
    listed = list_paths(base_url, run_id, tmp_path)
    assert state_path in listed and sampler_path in listed, listed
    assert listed[state_path]["checkpoint_type"] == "training"
    assert listed[state_path]["checkpoint_id"] == parsed_state.checkpoint_id
    assert listed[sampler_path]["checkpoint_type"] == "sampler"
    assert listed[sampler_path]["checkpoint_id"] == parsed_sampler.checkpoint_id

    table = run_cli(base_url, "checkpoint", "list", "--run-id", run_id, cwd=tmp_path, fmt="table").stdout
    assert f"2 checkpoints for run {run_id}" in table, table
    assert state_path in table and sampler_path in table, table

    # --- `tinker checkpoint download` of the training checkpoint (export → signed URLs → delete export).
    out_dir = tmp_path / "downloads"
    dl = cli_json(base_url, "checkpoint", "download", state_path, "--output", str(out_dir), cwd=tmp_path)
    assert dl["checkpoint_path"] == state_path
    dest = Path(dl["destination"])
    assert dest == out_dir / state_path.replace("tinker://", "").replace("/", "_")
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files, files
    assert dl.get("file_size_bytes") == sum((dest / f).stat().st_size for f in files)

    config = json.loads((dest / "adapter_config.json").read_text())
    assert config.get("r") == 4, config
    tensors = load_file(str(dest / "adapter_model.safetensors"))
    lora_a = [k for k in tensors if "lora_A" in k]
    lora_b = [k for k in tensors if "lora_B" in k]
    assert lora_a and lora_b, list(tensors)[:20]
    assert all(4 in tensors[k].shape for k in lora_a + lora_b)
    # One optimizer step moved lora_B off its zero init.
    assert any(tensors[k].abs().sum() > 0 for k in lora_b)

    # The originals remain; the temporary external-weights export (made in a new training run the CLI
    # started from the state) was deleted after the download.
    listed = list_paths(base_url, run_id, tmp_path)
    assert state_path in listed and sampler_path in listed, listed
    rest = tinker.RestClient(base_url=base_url)
    runs = rest.list_training_runs(limit=100).result().training_runs
    export_runs = [r for r in runs if (r.user_metadata or {}).get("created_by") == "tinker checkpoint download"]
    assert export_runs, runs
    export_run = export_runs[0]  # newest first
    assert export_run.training_run_id != run_id
    assert export_run.base_model == ALIAS and export_run.lora_rank == 4, export_run
    assert rest.list_checkpoints(export_run.training_run_id).result().checkpoints == []

    # --- `tinker checkpoint delete --yes` of the sampler checkpoint.
    deleted = cli_json(base_url, "checkpoint", "delete", "--yes", sampler_path, cwd=tmp_path)
    assert deleted == {"deleted_count": 1, "failed": []}, deleted

    listed = list_paths(base_url, run_id, tmp_path)
    assert sampler_path not in listed and state_path in listed, listed
    rest_paths = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert rest_paths == set(listed), (rest_paths, set(listed))
