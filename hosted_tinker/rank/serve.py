"""A worker process: build this rank (plan, model, trainer, and on rank 0 the embedded
sampler), then run the server's calls one at a time.

Calls name a component and a method, ``"trainer.optim_step"``; the server knows from the
method's ``@rank_call`` declaration which ranks to send it to. A failure is answered by its
kind (``core.messages``), which the server raises as the same ``core.errors`` class.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any, Literal

import torch

from hosted_tinker.core import losses
from hosted_tinker.core.errors import GroupBroken, PeerFailed, UserError
from hosted_tinker.core.messages import Callback, recv, send
from hosted_tinker.core.tiny_model import build_tiny_model, weights_sha256
from hosted_tinker.core.types import Capabilities
from hosted_tinker.rank import memory
from hosted_tinker.rank.plans import PlanOptions, plan_module
from hosted_tinker.rank.sampler import EmbeddedSampler
from hosted_tinker.rank.trainer import Trainer

log = logging.getLogger("hosted_tinker.rank")


@dataclass(frozen=True)
class RankSpec:
    """Everything a worker process needs to build its rank (picklable: it crosses ``spawn``)."""

    backend: str  # a key of ``rank.plans.PLANS``
    options: PlanOptions
    model_path: str
    rank: int
    devices: tuple[str, ...]  # one per rank
    init_method: str  # tcp://host:port of the group's store, hosted by the server, fresh for every start
    dtype: str = "float32"
    lora_alpha: float = 32.0
    lora_compute: str = "float32"  # LoRA's products in float32 or in the base's dtype (rank.adapters)
    shares_gpu: bool = False  # a vLLM the server launches runs on a GPU of these ranks
    max_seq_len: int | None = None
    # What model_path is on the server's machine: a hub id (each node downloads it), a folder
    # (every node needs it at the same path), or the built-in tiny model (a node without it
    # builds it, and must get the server's weights: tiny_sha256).
    model_source: Literal["hub", "folder", "tiny"] = "hub"
    tiny_sha256: str | None = None


def model_here(spec: RankSpec) -> str:
    """``spec.model_path`` on this rank's machine. A node other than the server's lacks the
    server's data directory: it builds the built-in tiny model at the same path (or, where it
    cannot write there, in its own cache) and every rank checks it holds the server's weights; a
    model folder a node does not have is named (loading it from the hub under its path's name
    failed with a message about repo ids). Megatron reads a hub id's files itself: they are
    downloaded first (the HF loaders of the other backends download as they load)."""
    path = Path(spec.model_path)
    if spec.model_source == "hub":
        if spec.backend != "megatron":
            return spec.model_path
        from huggingface_hub import snapshot_download

        return snapshot_download(spec.model_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    host = socket.gethostname()
    if spec.model_source == "folder":
        if path.is_dir():
            return spec.model_path
        raise RuntimeError(
            f"the model folder {path} is not on {host}: every node needs it at the same path "
            "(or serve a Hugging Face id, which each node downloads)"
        )
    try:
        built = build_tiny_model(path)
    except OSError:  # node 0's data directory is not writable here: the bytes matter, not the path
        built = build_tiny_model(Path.home() / ".cache" / "hosted-tinker" / f"tiny-{spec.tiny_sha256}")
    if weights_sha256(built) != spec.tiny_sha256:
        raise RuntimeError(
            f"the built-in tiny model at {built} on {host} differs from the server's: "
            "install the same torch and transformers on every node"
        )
    return str(built)


@dataclass
class Rank:
    """What a worker process serves: ``trainer`` on every rank, ``sampler`` on rank 0."""

    capabilities: Capabilities
    trainer: Trainer
    sampler: EmbeddedSampler | None


def build_rank(spec: RankSpec) -> Rank:
    model_path = model_here(spec)
    plan = plan_module(spec.backend).Plan(spec.rank, list(spec.devices), spec.init_method, spec.options)
    model = plan.build_model(model_path, dtype=spec.dtype, lora_alpha=spec.lora_alpha, lora_compute=spec.lora_compute)
    options = spec.options
    activation_memory = options.activation_budget(spec.devices, spec.shares_gpu)
    trainer = Trainer(model, plan, options.microbatch_tokens, options.recompute_above_tokens, activation_memory)
    shared = getattr(model, "shareable_base", None)  # a tree over the trainer's own weights, if it has one
    vision = getattr(model, "vision", None)  # a vision-language model's tower (``rank.vision``), if it feeds images
    sampler = (
        EmbeddedSampler(shared, model_path, spec.lora_compute, vision)
        if spec.rank == 0 and shared is not None
        else None
    )
    max_seq_len = spec.max_seq_len or model.max_positions
    capabilities = Capabilities(
        backend=spec.backend,
        arch=model.arch,
        losses=tuple(losses.LOSSES),
        max_seq_len=max_seq_len,
        max_tokens_per_batch=max(max_seq_len, 1 << 20),
        vocab_size=model.vocab_size,
        sampling=sampler is not None,
        devices=spec.devices,
        replicas=plan.replicas,
        dtype=spec.dtype,
        lora_compute=spec.lora_compute,
        activation_memory_gib=activation_memory / 2**30 if isinstance(activation_memory, float) else activation_memory,
        family=model.family,
        routed_experts=model.routed_experts,
        replay_routing=model.replay_routing,
        moe_layers=model.moe_layers,
        linear_attention_layers=model.linear_attention_layers,
        images=vision is not None,
        image_token_id=vision.image_token_id if vision is not None else -1,
        lora_groups=model.lora_groups,
        lora_params_per_rank=model.lora_params_per_rank,
    )
    return Rank(capabilities, trainer, sampler)


def local_rank(model_path: str, backend: str = "peft", **options: Any) -> Rank:
    """A one-rank ``Rank`` in this process (tests and benchmarks call it directly)."""
    settings = {k: options.pop(k) for k in ("dtype", "lora_alpha", "lora_compute", "max_seq_len") if k in options}
    device = options.pop("device", "cpu")
    spec = RankSpec(backend, plan_module(backend).Options(**options), model_path, 0, (device,), "", **settings)
    return build_rank(spec)


def serve_remote(
    address: tuple[str, int], authkey: bytes, generation: int, rank: int, factory: Callable[[], Any]
) -> None:
    """Entry point of a rank on another node than the server's (started by ``node.agent``):
    connect to the server's cluster port, say which rank of which group this is, then serve
    over that connection as a local rank does over its pipe."""
    conn = Client(address, family="AF_INET", authkey=authkey)
    send(conn, "rank", generation, rank, os.getpid())
    serve(conn, factory)


def serve(conn: Connection, factory: Callable[[], Any]) -> None:
    """Entry point of the worker process; returns when told to stop or when the server is gone."""
    # Ctrl-C and SIGTERM are the server's to handle (a SIGTERM to the whole process group, as
    # systemd or a terminal may send, must leave the ranks up while it parks every model); the
    # server stops us with a message, or SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    try:
        rank = factory()
    except UserError as e:  # a model or setting this server refuses: the gateway says it in one line
        send(conn, "error", str(e))
        return
    except BaseException as e:
        log.exception("could not build the rank")
        send(conn, "error", f"{type(e).__name__}: {e}")
        return
    send(conn, "ready", rank.capabilities, memory.snapshot())
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):  # the server exited
            return
        if message[0] == "stop":
            return
        _, method, args, kwargs = message
        kwargs = {k: _remote(conn, v) if isinstance(v, Callback) else v for k, v in kwargs.items()}
        try:
            result = functools.reduce(getattr, method.split("."), rank)(*args, **kwargs)
            reply: tuple = ("ok", _portable(result))
        except UserError as e:
            reply = ("user_error", str(e))
        except PeerFailed as e:  # another rank's failure, which that rank reports
            reply = ("peer_failed", str(e))
        except GroupBroken as e:  # the server replaces the whole group
            log.error("%s: %s", method, e)
            reply = ("group_broken", str(e))
        except Exception as e:
            log.exception("%s failed", method)
            if torch.cuda.is_initialized():  # after an OOM, give the cached blocks back
                torch.cuda.empty_cache()
            reply = ("error", describe(e))
        try:
            send(conn, *reply, memory.snapshot())  # the server keeps the last one (``Worker.memory``)
        except (EOFError, OSError):
            return
        except Exception as e:  # a result that cannot be pickled is our bug, not a reason to die
            send(conn, "error", f"{method.rpartition('.')[2]} returned what cannot be sent to the server: {e}")


def describe(error: Exception) -> str:
    """What the failed request's error says. Running out of memory is said plainly, with what
    it means here: a failed call leaves the rank as it was (``rank.trainer``)."""
    summary = f"{type(error).__name__}: {error}"
    out_of_memory = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)  # torch's CPU allocator
    )
    if out_of_memory:
        return f"out of memory ({summary}); the model is as it was before this request (a smaller batch may fit)"
    return summary


def _remote(conn: Connection, callback: Callback) -> Callable[..., Any]:
    """A stand-in that runs the server's callable and returns its answer."""

    def call(*args: Any) -> Any:
        if not callback.answer:
            send(conn, "notify", callback.name, args)
            return None
        send(conn, "callback", callback.name, args)
        kind, value = recv(conn)
        if kind == "answer_error":
            raise RuntimeError(f"the server's {callback.name} failed: {value}")
        return value

    return call


def _portable(value: Any) -> Any:
    """``value`` with every tensor on the CPU: the server process never touches the GPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _portable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value
