"""Bringing your own adapter (SDK 0.39's ``external_weights_upload_start`` / ``_finish``, written
from the service's API reference: 0.39 is not installable here, so the two calls are made over
HTTP as the SDK makes them, the files PUT to their signed URLs as its docs say). An export of
alice's run uploaded under bob's key trains, samples and exports exactly as alice's own
checkpoint does; every malformed upload is a 4xx naming what is wrong, with nothing stored and
the key's checkpoint bytes given back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import httpx
import pytest
import tinker
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from tinker import types

from tests.support.server import ALIAS, ServerProcess
from tests.support.tenants import serve_two_keys
from tests.support.training import assert_identical, train
from tests.support.uploads import LORA, download, finish, start, upload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

QUOTA = 1 << 20  # each key's checkpoint bytes: a few tiny rank-4 adapters, not a rank-64 one
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    srv, alice, bob = serve_two_keys(
        tmp_path_factory.mktemp("uploads"), tiny_model_dir, "--key-limit", f"checkpoint_bytes={QUOTA}"
    )
    yield srv, alice, bob
    srv.stop()


@pytest.fixture(scope="module")
def export(two_keys) -> tuple[dict[str, bytes], str, str]:
    """alice's export after two steps, its files as downloaded, and her training state of then."""
    srv, alice, _ = two_keys
    with tinker.ServiceClient(base_url=srv.base_url, api_key=alice) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        train(tc, 2)
        state = tc.save_state("at-two").result().path
        sampler = tc.save_weights_for_sampler("at-two").result().path
        path = tc.save_weights_external("at-two").result().path
        return download(sc.create_rest_client(), path), state, sampler


def stored(srv: ServerProcess, key: str) -> list[str]:
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        return [c.tinker_path for c in sc.create_rest_client().list_user_checkpoints(limit=1000).result().checkpoints]


def staged(srv: ServerProcess) -> list[Path]:
    return [p for p in (srv.data_dir / "checkpoints" / ".tmp").iterdir() if p.name.startswith("upload-")]


def test_an_export_uploaded_under_another_key_is_the_same_adapter(two_keys, export) -> None:
    srv, alice, bob = two_keys
    files, state, sampler = export
    r = start(srv.base_url, bob, destination_project_id="proj-byo")
    assert r.status_code == 200, r.text
    started = r.json()
    assert set(started["urls"]) == {WEIGHTS, CONFIG} and started["upload_id"] and started["expires"]
    for name, data in files.items():
        assert httpx.put(started["urls"][name], content=data, timeout=60).status_code == 204
    assert finish(srv.base_url, alice, started["upload_id"]).status_code == 404  # another key's upload
    done = finish(srv.base_url, bob, started["upload_id"])
    assert done.status_code == 200, done.text
    path = done.json()["tinker_path"]
    assert path.startswith("tinker://") and "/external_weights/" in path
    assert finish(srv.base_url, bob, started["upload_id"]).json() == done.json()  # a retried finish: the same
    assert path in stored(srv, bob) and path not in stored(srv, alice)
    assert not staged(srv)

    with (
        tinker.ServiceClient(base_url=srv.base_url, api_key=alice) as a,
        tinker.ServiceClient(base_url=srv.base_url, api_key=bob) as b,
    ):
        rest = b.create_rest_client()
        info = rest.get_weights_info_by_tinker_path(path).result()
        assert info.base_model == ALIAS and info.lora_rank == 4
        (row,) = [c for c in rest.list_user_checkpoints(limit=1000).result().checkpoints if c.tinker_path == path]
        assert row.checkpoint_type == "external" and row.size_bytes > 0
        with pytest.raises(tinker.NotFoundError):  # bob's adapter is not alice's to load
            a.create_training_client_from_state(path).result()

        # it trains as alice's own state does, loaded without its optimizer
        mine, theirs = (
            a.create_training_client_from_state(state).result(),
            b.create_training_client_from_state(path).result(),
        )
        assert_identical(train(theirs, 2), train(mine, 2))
        with pytest.raises(tinker.BadRequestError, match="without optimizer state"):
            b.create_training_client_from_state_with_optimizer(path).result()

        # it samples as her sampler checkpoint does
        prompt = types.ModelInput.from_ints(list(range(10, 20)))
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        hers = a.create_sampling_client(model_path=sampler).result()
        his = b.create_sampling_client(model_path=path).result()
        assert his.sample(prompt, 1, greedy).result().sequences[0].tokens == (
            hers.sample(prompt, 1, greedy).result().sequences[0].tokens
        )
        assert his.compute_logprobs(prompt).result() == hers.compute_logprobs(prompt).result()

        # and exports as it came: the same tensors, the config this server writes
        fresh = b.create_training_client_from_state(path).result()
        again = download(rest, fresh.save_weights_external("again").result().path)
        assert set(again) == {WEIGHTS, CONFIG}
        ours, uploaded = load_safetensors(again[WEIGHTS]), load_safetensors(files[WEIGHTS])
        assert ours.keys() == uploaded.keys() and all(ours[k].equal(uploaded[k]) for k in ours)
        assert json.loads(again[CONFIG]) == json.loads(files[CONFIG])


def _with_header(data: bytes, edit) -> bytes:
    """A safetensors file whose header ``edit`` changed (the tensors' bytes as they were)."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + size :]


def test_every_malformed_upload_is_refused_and_leaves_nothing(two_keys, export) -> None:
    srv, _, bob = two_keys
    files = export[0]
    tensors = load_safetensors(files[WEIGHTS])
    first = sorted(tensors)[0]
    config = json.loads(files[CONFIG])
    before = stored(srv, bob)

    def with_tensors(**changes) -> dict[str, bytes]:
        return files | {WEIGHTS: save_safetensors(tensors | changes)}

    def renamed(header: dict) -> None:
        header["base_model.model.model.layers.0.mlp.evil.lora_A.weight"] = header.pop(first)

    nan = tensors[first].clone()
    nan[0, 0] = float("nan")
    cases = [
        ({CONFIG: files[CONFIG]}, "adapter_model.safetensors was not uploaded"),
        ({WEIGHTS: files[WEIGHTS]}, "adapter_config.json was not uploaded"),
        (with_tensors(**{first: tensors[first][:, :-1].contiguous()}), "has shape"),
        (with_tensors(**{first: tensors[first].bfloat16()}), "is BF16, not F32"),
        (with_tensors(**{"base_model.model.model.layers.0.mlp.evil.lora_A.weight": tensors[first].clone()}), "evil"),
        (files | {WEIGHTS: _with_header(files[WEIGHTS], renamed)}, "has no tensor"),
        (with_tensors(**{first: nan}), "NaN"),
        (files | {WEIGHTS: b"not a safetensors file"}, "not a safetensors file"),
        (files | {CONFIG: json.dumps(config | {"r": 8}).encode()}, "r is 8"),
        (files | {CONFIG: json.dumps(config | {"use_dora": True}).encode()}, "use_dora"),
        (files | {CONFIG: json.dumps(config | {"target_modules": config["target_modules"][1:]}).encode()}, "missing"),
        (files | {CONFIG: b"[1, 2"}, "not JSON"),
    ]
    for sent, says in cases:
        r = upload(srv.base_url, bob, sent)
        assert r.status_code == 400 and says in r.json()["detail"], (says, r.text)
        assert not staged(srv) and stored(srv, bob) == before, says

    # refused at the start, naming the field
    for fields, status, says in [
        ({"base_model": "no/such-model"}, 400, "base_model"),
        ({"lora_config": LORA | {"rank": 0}}, 422, "rank"),
        ({"lora_config": LORA | {"train_attn": False, "train_mlp": False, "train_unembed": False}}, 400, "lora_config"),
        ({"destination_project_id": ""}, 400, "project_id"),
        ({"lora_config": LORA | {"rank": 512}}, 400, "lora_rank"),  # above the key's rank
        ({"lora_config": LORA | {"rank": 64}}, 403, "checkpoint_bytes"),  # more than the key may store
    ]:
        r = start(srv.base_url, bob, **fields)
        assert r.status_code == status and says in r.text, (fields, r.text)

    # the URLs: signed per file, bounded by the adapter's size, the file's own bytes only
    started = start(srv.base_url, bob).json()
    url = started["urls"][CONFIG]
    base, _, name = url.rpartition("/")
    assert httpx.put(f"{base}/..%2F..%2Fescape", content=b"x").status_code in (403, 404)
    assert httpx.put(f"{base.rpartition('/')[0]}/{'0' * 32}/{name}", content=b"{}").status_code == 403
    big = started["urls"][WEIGHTS]
    assert httpx.put(big, content=b"\0" * (len(files[WEIGHTS]) + (2 << 20))).status_code == 413
    zipped = httpx.put(url, content=b"x", headers={"Content-Encoding": "gzip"})
    assert zipped.status_code == 415
    assert finish(srv.base_url, bob, started["upload_id"]).status_code == 400  # nothing whole was PUT
    assert httpx.put(url, content=files[CONFIG]).status_code == 404  # refused: the upload is gone
    assert not staged(srv)

    # a key has a few uploads open at a time; the refused ones gave back what they reserved
    opened = [start(srv.base_url, bob) for _ in range(4)]
    assert all(r.status_code == 200 for r in opened)
    assert start(srv.base_url, bob).status_code == 403
    for r in opened[1:]:
        finish(srv.base_url, bob, r.json()["upload_id"])  # refused (no files): closed
    done = upload(srv.base_url, bob, files)  # opened[0] still holds its bytes: they all fit
    assert done.status_code == 200 and stored(srv, bob) == [done.json()["tinker_path"], *before]
