"""Where a rank finds the model on its own machine (``rank.serve.model_here``): a node other than
the server's has none of the server's data directory, so it builds the built-in tiny model where
the server has it and checks it got the same weights, and names a model folder it lacks."""

from __future__ import annotations

import socket
from pathlib import Path

import huggingface_hub
import pytest

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.core.tiny_model import build_tiny_model, weights_sha256
from hosted_tinker.rank.plans import plan_module
from hosted_tinker.rank.serve import RankSpec, model_here

pytestmark = pytest.mark.fast


def spec(path: Path | str, source: str, sha: str | None = None, backend: str = "peft") -> RankSpec:
    options = plan_module(backend).Options()
    return RankSpec(backend, options, str(path), 1, ("cpu", "cpu"), "", model_source=source, tiny_sha256=sha)


def test_a_node_builds_the_tiny_model_where_the_server_has_it_with_the_same_weights(tmp_path: Path) -> None:
    servers = build_tiny_model(tmp_path / "node0" / "tiny-qwen3")
    here = tmp_path / "node1" / "tiny-qwen3"  # the same path on another machine, empty
    assert model_here(spec(here, "tiny", weights_sha256(servers))) == str(here)
    assert weights_sha256(here) == weights_sha256(servers)
    assert model_here(spec(here, "tiny", weights_sha256(servers))) == str(here)  # there now: kept


def test_a_tiny_model_built_differently_is_refused_built_here_or_found(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="differs from the server's: install the same torch"):
        model_here(spec(tmp_path / "tiny-qwen3", "tiny", "0" * 64))
    other = build_tiny_model(tmp_path / "other", seed=1)  # a folder already there, other bytes
    with pytest.raises(RuntimeError, match="differs from the server's"):
        model_here(spec(other, "tiny", weights_sha256(build_tiny_model(tmp_path / "servers"))))


def test_where_the_servers_path_cannot_be_written_the_tiny_model_goes_to_this_nodes_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = weights_sha256(build_tiny_model(tmp_path / "node0" / "tiny-qwen3"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    here = model_here(spec(tmp_path / "a-file" / "tiny-qwen3", "tiny", sha))
    assert here == str(tmp_path / "home" / ".cache" / "hosted-tinker" / f"tiny-{sha}")
    assert weights_sha256(here) == sha


def test_a_model_folder_missing_here_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "my-model"
    with pytest.raises(RuntimeError, match=f"{missing} is not on {socket.gethostname()}: every node needs it"):
        model_here(spec(missing, "folder"))
    missing.mkdir(parents=True)
    assert model_here(spec(missing, "folder")) == str(missing)


def test_a_hub_id_is_left_to_the_loader_and_downloaded_for_megatron(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert model_here(spec("Qwen/Qwen3-8B", "hub")) == "Qwen/Qwen3-8B"
    fetched: list[str] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **_: fetched.append(repo) or str(tmp_path))
    assert model_here(spec("Qwen/Qwen3-8B", "hub", backend="megatron")) == str(tmp_path)
    assert fetched == ["Qwen/Qwen3-8B"]


def test_a_model_folder_is_sent_by_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in ("models/m", "~/models/m"):
        assert ServerConfig(model=given).model_path() == str(tmp_path / "models" / "m")
    assert ServerConfig(model="Qwen/Qwen3-8B").model_path() == "Qwen/Qwen3-8B"
