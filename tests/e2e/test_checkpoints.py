"""Checkpoints through the real SDK: exact resume, sampler weights in Tinker's adapter layout
(which the cookbook's tools read, and PEFT loads under PEFT's names), integrity, path rules, the
REST surface, and a SIGKILL restart."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.server import ALIAS, start_server
from tests.support.training import ADAM, DATA, assert_identical, train  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_resume_with_optimizer_is_bit_identical(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
        train(tc, 3)
        path = tc.save_state("resume-a").result().path
        assert path == f"tinker://{tc.get_info().model_id}/weights/resume-a"
        uninterrupted = train(tc, 3)
    with tinker.ServiceClient(base_url=base_url) as fresh:  # a new client, as after a crash
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.get_info().model_id.startswith(
            f"{fresh._session_id}:train:" if hasattr(fresh, "_session_id") else ""
        )
        assert_identical(train(resumed, 3), uninterrupted)
        # Without the optimizer: same weights (first step equal), fresh Adam moments (then not).
        weights_only = fresh.create_training_client_from_state(path).result()
        again = train(weights_only, 3)
        assert again[0][0] == uninterrupted[0][0]
        assert again[1][0] != uninterrupted[1][0]


def test_load_state_on_an_existing_client(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=1).result()
        train(tc, 2)
        path = tc.save_state("legacy").result().path
        expected = train(tc, 2)
        other = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=2).result()
        other.load_state_with_optimizer(path).result()
        assert_identical(train(other, 2), expected)
        small = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="rank"):
            small.load_state(path).result()
        train(small, 1)  # the failed load did not poison the model
        # As on the official service, only as a client's first request: later, a 400 that says
        # what to use instead, and the model trains on as it was.
        with pytest.raises(tinker.BadRequestError, match=r"LoadWeights is not permitted with seq_id 6\b.*from_state"):
            other.load_state(path).result()
        assert_identical(train(other, 1), train(tc, 1))  # both went on from the same state


def test_sampler_weights_are_tinkers_adapter_layout(base_url, server, tiny_model_dir, tmp_path):
    """PEFT's files and key names, but for the unembedding's LoRA, which Tinker's adapters call
    ``model.unembed_tokens``: renamed to PEFT's ``lm_head``, PEFT loads the adapter and scores as
    the server does; as written, the cookbook's ``build_hf_model`` merges it (on this tied model
    into ``embed_tokens``, as it merges the service's), each weight the base's plus scale·B·A."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=3).result()
        train(tc, 3)
        path = tc.save_weights_for_sampler("same-name").result().path
        tc.save_state("same-name").result()  # both kinds may share a name
        served = tc.forward(DATA, "cross_entropy").result()
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    assert kind == "sampler_weights"
    directory = server.data_dir / "checkpoints" / run_id / kind / name
    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(directory / "adapter_model.safetensors")
    head = "base_model.model.model.unembed_tokens"
    assert {f"{head}.lora_A.weight", f"{head}.lora_B.weight"} <= set(tensors)
    assert not any(".lm_head." in k for k in tensors)
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {k.replace(head, "base_model.model.lm_head"): v for k, v in tensors.items()},
        peft_dir / "adapter_model.safetensors",
    )
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    for datum, out in zip(DATA, served.loss_fn_outputs, strict=True):
        tokens = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0].float(), -1)
        local = logp.gather(-1, targets[:, None])[:, 0].numpy()
        np.testing.assert_allclose(local, out["logprobs"].to_numpy(), atol=1e-5)

    build_hf_model(base_model=str(tiny_model_dir), adapter_path=str(directory), output_path=str(tmp_path / "merged"))
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    original = load_file(tiny_model_dir / "model.safetensors")
    scale = config["lora_alpha"] / config["r"]
    for adapted, module in ((head, "model.embed_tokens"), ("base_model.model.model.layers.1.self_attn.q_proj", None)):
        key = f"{module or adapted.removeprefix('base_model.model.')}.weight"
        delta = scale * tensors[f"{adapted}.lora_B.weight"] @ tensors[f"{adapted}.lora_A.weight"]
        torch.testing.assert_close(merged[key], original[key] + delta, rtol=0, atol=1e-6)


def test_corrupted_checkpoint_is_refused_naming_the_file(base_url, server):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        path = tc.save_state("to-corrupt").result().path
        run_id, kind, name = path.removeprefix("tinker://").split("/")
        target = server.data_dir / "checkpoints" / run_id / kind / name / "optimizer.safetensors"
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        with pytest.raises(tinker.RequestFailedError, match="optimizer.safetensors"):
            sc.create_training_client_from_state_with_optimizer(path).result()
        fresh = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match="optimizer.safetensors"):
            fresh.load_state_with_optimizer(path).result()
        train(fresh, 1)


def test_names_and_paths_are_validated(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        for bad in ("../escape", "a/b", ".hidden", ""):
            with pytest.raises(tinker.BadRequestError, match="not a valid checkpoint name"):
                tc.save_state(bad).result()
        tc.save_state("dup").result()
        with pytest.raises(tinker.BadRequestError, match="already exists"):
            tc.save_state("dup").result()
        assert tc.save_state("dup", overwrite=True).result().path.endswith("/weights/dup")
        run_id = tc.get_info().model_id
        for bad_path in (f"tinker://{run_id}/weights/../../x", f"tinker://{run_id}/nonsense/dup", "s3://x/y/z"):
            with pytest.raises(tinker.BadRequestError):
                sc.create_training_client_from_state(bad_path).result()
        with pytest.raises(tinker.NotFoundError):
            sc.create_training_client_from_state(f"tinker://{run_id}/weights/never-saved").result()
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            tc.save_state("short-lived", ttl_seconds=10).result()
        train(tc, 1)


def test_rest_surface(base_url):
    with tinker.ServiceClient(base_url=base_url, user_metadata={"team": "x"}) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, user_metadata={"purpose": "rest"}).result()
        run_id = tc.get_info().model_id
        state = tc.save_state("r1", ttl_seconds=7200, user_metadata={"k": "v"}).result().path
        sampler = tc.save_weights_for_sampler("r1").result().path
        rest = sc.create_rest_client()

        run = rest.get_training_run(run_id).result()
        assert run.base_model == ALIAS and run.lora_rank == 4 and run.user_metadata == {"purpose": "rest"}
        assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
        assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run_id
        assert run_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]

        checkpoints = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert set(checkpoints) == {"weights/r1", "sampler_weights/r1"}
        assert checkpoints["weights/r1"].checkpoint_type == "training"
        assert checkpoints["weights/r1"].size_bytes > 0 and checkpoints["weights/r1"].expires_at is not None
        assert checkpoints["weights/r1"].user_metadata == {"k": "v"}
        assert checkpoints["sampler_weights/r1"].expires_at is None

        rest.publish_checkpoint_from_tinker_path(state).result()
        assert next(c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == state).public
        rest.unpublish_checkpoint_from_tinker_path(state).result()
        rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert not listed["weights/r1"].public and listed["weights/r1"].expires_at is None

        info = rest.get_weights_info_by_tinker_path(state).result()
        assert (info.base_model, info.lora_rank, info.is_lora) == (ALIAS, 4, True)
        assert rest.get_weights_info_by_tinker_path(sampler).result() == info  # any kind: its run's shape

        sampling = sc.create_sampling_client(model_path=sampler).result()
        sampler_info = rest.get_sampler(sampling._sampling_session_id).result()
        assert sampler_info.base_model == ALIAS and sampler_info.model_path == sampler

        # a checkpoint id without its kind: a 400 that says which form it takes (#43 item 4), nothing deleted
        with pytest.raises(tinker.BadRequestError, match="weights/r1 or sampler_weights/r1"):
            rest.delete_checkpoint(run_id, "r1").result()
        rest.delete_checkpoint_from_tinker_path(sampler).result()
        assert [c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints] == ["weights/r1"]
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint_from_tinker_path(sampler).result()

        session_id = run_id.split(":train:")[0]
        assert session_id in rest.list_sessions(limit=1000).result().sessions
        session = rest.get_session(session_id).result()
        assert run_id in session.training_run_ids and session.user_metadata == {"team": "x"}


def test_expired_checkpoints_are_deleted(tmp_path):
    from types import SimpleNamespace

    from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath
    from hosted_tinker.server.persistence.store import Store
    from hosted_tinker.server.serving.checkpoints import CheckpointService
    from hosted_tinker.server.serving.tenancy import Tenancy

    store = Store(tmp_path / "db.sqlite")
    files = CheckpointFiles(tmp_path / "checkpoints")
    training = SimpleNamespace(backend=None, scheduler=None, store=store)
    service = CheckpointService(training, files, files, b"k", tenancy=Tenancy(store))
    keep, expire = TinkerPath("run:train:0", "weights", "keep"), TinkerPath("run:train:0", "weights", "old")
    for path, ttl in ((keep, None), (expire, 3600)):
        files.write(path, {"a.bin": b"x"}, overwrite=False)
        store.put_checkpoint(path.run_id, path.kind, path.name, size_bytes=1, ttl_seconds=ttl, user_metadata={})
    store.update_checkpoint(expire.run_id, expire.kind, expire.name, expires_at=1.0)  # long past
    assert service.delete_expired() == 1
    assert files.exists(keep) and not files.exists(expire)
    assert [c.name for c in store.list_checkpoints()] == ["keep"]


def test_restart_after_sigkill_keeps_every_checkpoint_loadable(tmp_path, tiny_model_dir):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        sc = tinker.ServiceClient(base_url=srv.base_url)
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=5).result()
        train(tc, 2)
        path = tc.save_state("before-kill").result().path
        sampler_path = tc.save_weights_for_sampler("before-kill").result().path
        prompt = types.ModelInput.from_ints(list(range(10, 20)))
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        sampled = sc.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, greedy).result()
        expected = train(tc, 2)
        run_id = tc.get_info().model_id
        # Kill while a long forward_backward is running.
        long = [
            types.Datum(
                model_input=types.ModelInput.from_ints([5] * 1024),
                loss_fn_inputs={"target_tokens": [6] * 1024, "weights": [1.0] * 1024},
            )
        ] * 48
        tc.forward_backward(long, "cross_entropy")
    finally:
        srv.stop(signal.SIGKILL)
    # What a write interrupted by the kill leaves in the staging directory is cleared at start.
    leftover = tmp_path / "checkpoints" / ".tmp" / "tmpkilled"
    leftover.mkdir(parents=True, exist_ok=True)
    (leftover / "adapter_model.safetensors").write_bytes(b"half")

    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    assert not leftover.exists()
    try:
        with tinker.ServiceClient(base_url=srv.base_url) as sc2:
            rest = sc2.create_rest_client()
            assert run_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
            ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
            assert ids == {"weights/before-kill", "sampler_weights/before-kill"}
            resumed = sc2.create_training_client_from_state_with_optimizer(path).result()
            assert_identical(train(resumed, 2), expected)
            # Sampler weights saved by the earlier run sample exactly as they did then.
            again = sc2.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, greedy).result()
            assert again.sequences[0].tokens == sampled.sequences[0].tokens
            health = httpx.get(f"{srv.base_url}/healthz").json()
            assert health["status"] == "ok"
    finally:
        srv.stop()

    # The same data served under other names: the checkpoint's base model is not served here.
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), alias=None)
    try:
        with tinker.ServiceClient(base_url=srv.base_url) as sc3:
            with pytest.raises(tinker.BadRequestError, match="not served here"):
                sc3.create_training_client_from_state(path).result()
    finally:
        srv.stop()


def test_ephemeral_sampler_snapshots_and_their_retention(base_url, server):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        train(tc, 1)
        clients = [tc.save_weights_and_get_sampling_client() for _ in range(10)]
        ids = [c.result()._sampling_session_id for c in clients]
        assert len(set(ids)) == 10 and all(":sample:" in i for i in ids)
        rest = sc.create_rest_client()
        for sampler_id in ids[2:]:  # the newest 8 are kept
            info = rest.get_sampler(sampler_id).result()
            assert info.base_model == ALIAS and info.model_path is None
        for sampler_id in ids[:2]:
            with pytest.raises(tinker.NotFoundError):
                rest.get_sampler(sampler_id).result()
        snapshots = server.data_dir / "ephemeral" / tc.get_info().model_id / "sampler_weights"
        assert len(list(snapshots.iterdir())) == 8
        # Ephemeral snapshots are not checkpoints: nothing is listed.
        assert rest.list_checkpoints(tc.get_info().model_id).result().checkpoints == []
    assert list(snapshots.iterdir()) == []  # the finished session's snapshots are deleted


def test_manifest_lists_every_file(base_url, server):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        path = tc.save_state("manifest").result().path
    directory = server.data_dir / "checkpoints" / Path(path.removeprefix("tinker://"))
    manifest = json.loads((directory / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in directory.iterdir()} - {"manifest.json"}
    assert set(manifest) == on_disk
    assert {"adapter_model.safetensors", "optimizer.safetensors", "training_state.json"} <= on_disk


def test_checkpoints_written_with_peft_names_still_load():
    """This server wrote PEFT's ``lm_head`` before it wrote Tinker's ``unembed_tokens``: both read
    back to the same tensors under the ranks' (PEFT's) names, optimizer state alongside."""
    from safetensors.torch import save as save_safetensors

    from hosted_tinker.core.checkpoints import TinkerPath, state_from_files, state_to_files
    from hosted_tinker.core.types import AdapterState, LoraSpec

    head = "base_model.model.lm_head.lora_A.weight"
    weights = {
        head: torch.randn(4, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
    }
    optimizer = {f"{k}.exp_avg": torch.randn(v.shape) for k, v in weights.items()}
    state = AdapterState(LoraSpec(rank=4, seed=1), weights, optimizer, 3, torch.zeros(8, dtype=torch.uint8))
    path = TinkerPath.parse("tinker://run/weights/old")
    files = state_to_files(state, {"r": 4, "lora_alpha": 32}, "tiny")
    assert "model.unembed_tokens" in str(load_safetensors_keys(files["adapter_model.safetensors"]))
    old = dict(files, **{"adapter_model.safetensors": save_safetensors(weights)})  # as written before
    for written in (files, old):
        loaded = state_from_files(path, written).state
        assert loaded.weights.keys() == weights.keys() and loaded.optimizer.keys() == optimizer.keys()
        assert all(torch.equal(loaded.weights[k], v) for k, v in weights.items())


def load_safetensors_keys(data: bytes) -> list[str]:
    from safetensors.torch import load

    return list(load(data))
