"""Checkpoints on disk: ``tinker://`` paths, atomic writes, SHA-256 manifests, verified reads.

Layout: ``<root>/<run_id>/<kind>/<name>/`` holding the checkpoint's files and ``manifest.json``
(``{file: {"sha256", "bytes"}}``). A checkpoint is written into a temporary directory and
renamed into place, so a reader sees all of it or none of it; every read checks the manifest.

Kinds (protocol reference §9): ``weights`` (training state: adapter, optimizer moments, step
counter, RNG), ``sampler_weights`` (a PEFT adapter directory that ``PeftModel.from_pretrained``
and vLLM load as is) and ``external_weights`` (the same adapter, for download).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.types import OPTIMIZER_CONFIGS, AdapterState, LoraSpec

CheckpointType = Literal["training", "sampler", "external"]  # as the SDK's Checkpoint names a kind
KIND_TO_TYPE: dict[str, CheckpointType] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
MANIFEST = "manifest.json"
V = TypeVar("V")  # what a file's names map to: its tensors, or nothing (the names alone)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # an adapter's files, as PEFT names them
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" would let a trailing newline in
# Not starting with '.': a run id is a directory name, and "." or ".." would leave the root.
_RUN_ID = re.compile(r"[A-Za-z0-9_:\-][A-Za-z0-9_.:\-]{0,199}")
FORMAT_VERSION = 1


class CheckpointError(UserError):
    """A checkpoint that is missing, malformed, corrupted or incompatible."""


def validate_name(name: str, field: str = "path") -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(
            f"{field} {name!r} is not a valid checkpoint name: use 1-128 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-'"
        )
    return name


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<run_id>/<kind>/<name>``; the run id is the training model's id."""

    run_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str, field: str = "path") -> TinkerPath:
        """Parse ``path``; errors name ``field``, the request field it came in."""
        if not path.startswith("tinker://"):
            raise CheckpointError(f"{field} {path!r} is not a tinker:// path")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3:
            raise CheckpointError(f"{field} {path!r} must look like tinker://<run_id>/<kind>/<name>")
        run_id, kind, name = parts
        if kind not in KIND_TO_TYPE:
            raise CheckpointError(f"{field} {path!r}: checkpoint kind {kind!r} is not one of {', '.join(KIND_TO_TYPE)}")
        if not _RUN_ID.fullmatch(run_id):
            raise CheckpointError(f"{field} {path!r} has an invalid run id {run_id!r}")
        return cls(run_id, kind, validate_name(name, field))

    @classmethod
    def from_checkpoint_id(cls, run_id: str, checkpoint_id: str) -> TinkerPath:
        return cls.parse(f"tinker://{run_id}/{checkpoint_id}")

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> CheckpointType:
        return KIND_TO_TYPE[self.kind]

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CheckpointFiles:
    """Reads and writes checkpoint directories under one root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / ".tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def clear_staging(self) -> int:
        """Delete what a killed server left half-written or half-deleted in the staging
        directory (nothing there is a checkpoint: those are renamed into place whole). Only at
        start-up, before anything writes. Returns how many entries were removed."""
        leftovers = list(self._tmp.iterdir())
        for entry in leftovers:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        return len(leftovers)

    def staging_dir(self, prefix: str) -> Path:
        """A new directory in the staging area, for files that are not a checkpoint yet (an
        upload's); cleared at start-up like a half-made write."""
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=self._tmp))

    def directory(self, path: TinkerPath) -> Path:
        return self.root / path.run_id / path.kind / path.name

    def encrypted(self, path: TinkerPath) -> bool:
        """Whether ``path`` is an export encrypted to its recipients (its files are ``.age``):
        no key here opens it, so it cannot be loaded or sampled."""
        return path.kind == "external_weights" and not (self.directory(path) / WEIGHTS).is_file()

    def exists(self, path: TinkerPath) -> bool:
        return (self.directory(path) / MANIFEST).exists()

    def write(self, path: TinkerPath, files: dict[str, bytes], *, overwrite: bool) -> int:
        """Write atomically; return the total size in bytes."""
        final = self.directory(path)
        if final.exists() and not overwrite:
            raise CheckpointError(f"{path} already exists; save under another name or pass overwrite=True")
        staging = Path(tempfile.mkdtemp(dir=self._tmp))
        try:
            manifest = {}
            for name, data in files.items():
                with open(staging / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                manifest[name] = {"sha256": _sha256(data), "bytes": len(data)}
            (staging / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "files": manifest}, indent=1))
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # overwrite: move the old one aside first, then swap
                trash = Path(tempfile.mkdtemp(dir=self._tmp))
                os.replace(final, trash / "old")
                os.replace(staging, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return sum(len(d) for d in files.values())

    def read(self, path: TinkerPath, only: tuple[str, ...] | None = None) -> dict[str, bytes]:
        """The checkpoint's files (all, or ``only`` these), each checked against the manifest."""
        directory = self.directory(path)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())["files"]
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} does not exist") from None
        except (ValueError, KeyError):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupted") from None
        files = {}
        for name, expected in manifest.items():
            if only is not None and name not in only:
                continue
            try:
                data = (directory / name).read_bytes()
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {path}: file {name} is missing") from None
            if len(data) != expected["bytes"] or _sha256(data) != expected["sha256"]:
                raise CheckpointError(f"checkpoint {path}: file {name} fails its SHA-256 check (corrupted)")
            files[name] = data
        return files

    def link(self, source: TinkerPath, target: TinkerPath) -> int:
        """Make ``target`` the same checkpoint as ``source``, sharing its files (hard links; a
        copy where the filesystem has none), after checking them against the manifest. Files
        are never rewritten in place, so neither side can change the other; deleting one
        leaves the other whole. Returns the size in bytes."""
        files = self.read(source)  # verified: a corrupt source is refused, not propagated
        if self.directory(target).exists():
            raise CheckpointError(f"{target} already exists")
        staging = Path(tempfile.mkdtemp(dir=self._tmp))
        try:
            for name in (*files, MANIFEST):
                try:
                    os.link(self.directory(source) / name, staging / name)
                except OSError:
                    shutil.copy2(self.directory(source) / name, staging / name)
            self.directory(target).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, self.directory(target))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return sum(len(d) for d in files.values())

    def delete(self, path: TinkerPath) -> None:
        directory = self.directory(path)
        if directory.exists():
            trash = Path(tempfile.mkdtemp(dir=self._tmp))
            os.replace(directory, trash / "gone")
            shutil.rmtree(trash, ignore_errors=True)


# ---- training state <-> files ------------------------------------------------------------------


# Tinker's adapters name the unembedding's LoRA ``model.unembed_tokens`` (the cookbook's ``weights``
# tools map it to ``lm_head``, or to ``embed_tokens`` where the embeddings are tied); PEFT, this
# server's ranks and vLLM name it after the module. Files say Tinker's name; the ranks see PEFT's.
PEFT_HEAD, TINKER_HEAD = "base_model.model.lm_head.", "base_model.model.model.unembed_tokens."
# Modules Tinker's adapters name otherwise than transformers does, by the checkpoint's model_type
# (``Capabilities.family``): gpt-oss's attention is ``attn`` in the service's files (the cookbook's
# merge maps it back to ``self_attn``).
TINKER_MODULES: dict[str, tuple[tuple[str, str], ...]] = {"gpt_oss": ((".self_attn.", ".attn."),)}


def _tinker_name(name: str, family: str) -> str:
    for ours, theirs in TINKER_MODULES.get(family, ()):
        name = name.replace(ours, theirs)
    return TINKER_HEAD + name.removeprefix(PEFT_HEAD) if name.startswith(PEFT_HEAD) else name


def _peft_name(name: str, family: str) -> str:
    for ours, theirs in TINKER_MODULES.get(family, ()):
        name = name.replace(theirs, ours)
    return PEFT_HEAD + name.removeprefix(TINKER_HEAD) if name.startswith(TINKER_HEAD) else name


def tinker_keys(weights: dict[str, torch.Tensor], family: str = "") -> dict[str, torch.Tensor]:
    """``weights`` under the names Tinker's adapters use for a model of ``family``."""
    return {_tinker_name(k, family): v for k, v in weights.items()}


def peft_keys(weights: dict[str, V], family: str = "") -> dict[str, V]:
    """``weights`` under PEFT's names, whichever a file used (checkpoints written before this
    server wrote Tinker's names hold PEFT's)."""
    return {_peft_name(k, family): v for k, v in weights.items()}


def _config_modules(config: dict, family: str, rename) -> dict:
    """``adapter_config.json`` with its ``target_modules`` renamed as the weights are."""
    modules = config.get("target_modules")
    if not TINKER_MODULES.get(family) or not isinstance(modules, list):
        return config
    return config | {"target_modules": [rename(f".{m}.", family)[1:-1] for m in modules]}


def peft_config(config: dict, family: str = "") -> dict:
    """An ``adapter_config.json`` as read from a file, under PEFT's module names."""
    return _config_modules(config, family, _peft_name)


def peft_adapter_files(adapter_config: dict, weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors`` (what vLLM loads)."""
    return {
        CONFIG: json.dumps(adapter_config, indent=2).encode(),
        WEIGHTS: save_safetensors({k: v.contiguous() for k, v in weights.items()}),
    }


def adapter_files(adapter_config: dict, weights: dict[str, torch.Tensor], family: str = "") -> dict[str, bytes]:
    """An adapter directory as Tinker writes one, which every checkpoint and export holds: PEFT's
    files, with Tinker's names for a model of ``family`` (``tinker_keys``; routed experts' LoRA as
    ``rank.experts`` names them), so the cookbook's ``weights`` tools read it as they read the service's."""
    return peft_adapter_files(_config_modules(adapter_config, family, _tinker_name), tinker_keys(weights, family))


def adapter_weights(data: bytes, family: str = "") -> dict[str, torch.Tensor]:
    """The tensors of an ``adapter_model.safetensors`` under the ranks' (PEFT's) names."""
    return peft_keys(load_safetensors(data), family)


def state_to_files(state: AdapterState, adapter_config: dict, base_model: str, family: str = "") -> dict[str, bytes]:
    files = adapter_files(adapter_config, state.weights, family)
    files["optimizer.safetensors"] = save_safetensors({k: v.contiguous() for k, v in state.optimizer.items()})
    if state.gradients:  # a parked model's, not yet applied by an optim_step
        files["gradients.safetensors"] = save_safetensors({k: v.contiguous() for k, v in state.gradients.items()})
    meta = {
        "format": FORMAT_VERSION,
        "base_model": base_model,
        "lora": state.lora.__dict__,
        "steps": state.steps,
        "rng_state": base64.b64encode(state.rng_state.numpy().tobytes()).decode(),
    }
    files["training_state.json"] = json.dumps(meta, indent=1).encode()
    return files


@dataclass(frozen=True)
class LoadedState:
    base_model: str
    state: AdapterState


def training_meta(path: TinkerPath, files: dict[str, bytes]) -> tuple[str, LoraSpec]:
    """Base model and LoRA shape, from ``training_state.json`` alone."""
    try:
        meta = json.loads(files["training_state.json"])
        return meta["base_model"], LoraSpec(**meta["lora"])
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path} is not a training-state checkpoint (missing {e})") from None


def state_from_files(path: TinkerPath, files: dict[str, bytes], family: str = "") -> LoadedState:
    try:
        meta = json.loads(files["training_state.json"])
        weights = adapter_weights(files["adapter_model.safetensors"], family)
        optimizer = load_safetensors(files["optimizer.safetensors"])
        rng = torch.frombuffer(bytearray(base64.b64decode(meta["rng_state"])), dtype=torch.uint8)
        gradients = load_safetensors(files["gradients.safetensors"]) if "gradients.safetensors" in files else {}
        state = AdapterState(LoraSpec(**meta["lora"]), weights, optimizer, int(meta["steps"]), rng, gradients)
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path} is not a training-state checkpoint (missing {e})") from None
    return LoadedState(meta["base_model"], state)


def describe(path: TinkerPath, files: dict[str, bytes]) -> dict:
    """What ``weights_info`` reports: base model and LoRA shape of a training checkpoint."""
    return description(*training_meta(path, files))


def description(base_model: str, lora: LoraSpec) -> dict:
    """What ``weights_info`` reports of weights of ``lora``'s shape on ``base_model``."""
    return {
        "base_model": base_model,
        "is_lora": True,
        "lora_rank": lora.rank,
        "train_attn": lora.train_attn,
        "train_mlp": lora.train_mlp,
        "train_unembed": lora.train_unembed,
        "optimizer_config": OPTIMIZER_CONFIGS[lora.optimizer],
    }
