"""Typed server settings, filled from CLI flags (and, for tests, directly)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

TINY_MODEL_NAME = "hosted-tinker/tiny-qwen3"
VLLM_LORA_RANKS = {1, 8, 16, 32, 64, 128, 256, 320, 512}  # the --max-lora-rank values vLLM accepts
CLUSTER_KEY_ENV = "HOSTED_TINKER_CLUSTER_KEY"


def read_cluster_key(path: Path | None) -> bytes:
    """The secret the nodes of a multi-node server prove to each other: the file's contents, or
    the environment's ``HOSTED_TINKER_CLUSTER_KEY``. What crosses the cluster port is unpickled,
    so it is never open: no key, no cluster."""
    key = path.read_bytes().strip() if path is not None else os.environ.get(CLUSTER_KEY_ENV, "").encode()
    if len(key) < 16:
        where = f"--cluster-key-file {path}" if path is not None else f"${CLUSTER_KEY_ENV}"
        raise ValueError(
            f"several nodes need a cluster key of at least 16 characters in {where}, the same on every node "
            "(e.g. `openssl rand -hex 32`)"
        )
    return key


def visible_gpu(device: str, inherited: str | None) -> str:
    """``cuda:N`` as a child's ``CUDA_VISIBLE_DEVICES`` must name it: the N-th entry of this
    process's own list where it has one (``cuda:0`` under ``2,3`` is GPU 2), else N."""
    index = int(device.partition(":")[2] or 0)
    if not inherited or not inherited.strip():
        return str(index)
    visible = inherited.split(",")
    if index >= len(visible):
        raise ValueError(f"{device}: CUDA_VISIBLE_DEVICES={inherited} makes {len(visible)} GPU(s) visible")
    return visible[index].strip()


def parse_devices(spec: str) -> list[str]:
    """One device per rank: ``cpu`` or ``cpu:N`` (N ranks on the CPU), ``cuda`` or ``cuda:0,1,...``."""
    kind, _, rest = spec.strip().partition(":")
    if kind == "cpu":
        if rest and (not rest.isdigit() or int(rest) < 1):
            raise ValueError(f"train devices {spec!r}: cpu:N needs a whole number of ranks N >= 1")
        return ["cpu"] * (int(rest) if rest else 1)
    if kind == "cuda":
        ids = rest.split(",") if rest else ["0"]
        if not all(i.strip().isdigit() for i in ids):
            raise ValueError(f"train devices {spec!r}: cuda:I,J,... needs GPU numbers")
        devices = [f"cuda:{int(i)}" for i in ids]
        if len(set(devices)) != len(devices):
            raise ValueError(f"train devices {spec!r}: a GPU can hold one rank only")
        return devices
    raise ValueError(f"train devices {spec!r}: expected cpu, cpu:N, cuda or cuda:I,J,...")


class ServerConfig(BaseModel):
    model: str | None = None  # HF id or local dir; None = the built-in tiny model
    model_names: list[str] = Field(default_factory=list)  # extra names the model answers to
    # What get_info reports for the SDK's get_tokenizer(): by default the model's path or hub id,
    # which a client on another machine can load only if it has the same path or hub access.
    tokenizer_id: str | None = None
    host: str = "127.0.0.1"  # loopback unless asked: the API is open until a key is configured
    port: int = 8000
    data_dir: Path = Path("./hosted-tinker-data")
    backend: str = "peft"  # a key of rank.plans.PLANS (checked by the CLI's choices and at start-up)
    device: str = "cpu"  # the one device of a single-process backend
    # Data parallel: a device per rank, "cpu:2" or "cuda:0,1" (parse_devices).
    train_devices: str | None = None
    backend_options: dict[str, str] = Field(default_factory=dict)  # checked by rank.plans.backend_options
    # Several machines: this server is node 0 of ``nnodes``, each with the devices above; the
    # other nodes' agents (``hosted-tinker node``) connect to master_addr:master_port.
    nnodes: int = Field(1, ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, ge=0, le=65535)  # 0: any free port (tests)
    cluster_key_file: Path | None = None  # else $HOSTED_TINKER_CLUSTER_KEY (read_cluster_key)
    dtype: str = "float32"
    lora_alpha: float = 32.0
    # The dtype of LoRA's products and of the update's sum (rank.adapters): float32 whatever the
    # base (PEFT's arithmetic over float32 adapters), or the base's (as under torch.autocast)
    lora_compute: Literal["float32", "base"] = "float32"
    max_seq_len: int | None = None
    sample_batch_window_s: float = 0.01  # how long an idle sampler waits to gather a batch
    # The embedded sampler shares the training worker: a request's n * (prompt + max_tokens), the
    # positions its rows hold, is at most max_sample_tokens (400 above), and a run gives the
    # worker back after each sample_slice_s of decoding, so training and other keys' runs wait
    # for a slice, not for a whole run.
    max_sample_tokens: int = Field(65536, ge=1)
    sample_slice_s: float = Field(0.1, ge=0)
    poll_timeout_s: float = 30.0  # long-poll cap of retrieve_future (the SDK times out at 45 s)
    proto_compress: bool = False  # ask the SDK to zstd-compress forward_backward bodies
    # The SDK's transport, chosen by the server in client/config. Against this server (HTTP/1.1)
    # httpx answers a call ~5 ms sooner than pyqwest (benchmarks/overhead.py).
    sdk_transport: Literal["httpx", "pyqwest"] = "httpx"
    max_body_bytes: int = Field(256 << 20, ge=1024)  # a request body, also once inflated (413 above)
    # The body of a control call (every route not declared large_body): sessions, saves, heartbeats.
    max_control_body_bytes: int = Field(1 << 20, ge=1024)
    # The body of a sampling or completion request (large_body("prompt")): a prompt and its
    # targets (~20 MB for 40K tokens with dense top-64 targets: raise it for longer contexts);
    # JSON, parsed off the event loop but for json.loads' own share (~12-50 ms per MiB).
    max_prompt_body_bytes: int = Field(32 << 20, ge=1024)
    # Request bodies the API process holds at once, as received (twice: while it is read) and as
    # inflated (503 above; a key's share: quotas.Limits.body_bytes, 429 above; api.inflight); at
    # least one largest body, read and inflated.
    max_inflight_body_bytes: int = Field(1 << 30, ge=1024)
    max_pending: int = Field(1024, ge=1)  # accepted, unfinished requests over all models (429 above)
    max_pending_per_model: int = Field(64, ge=1)  # the same per training model or sampling session
    max_pending_bytes: int = Field(4 << 30, ge=1)  # the forward_backward batches they hold (429 above)
    # Several models' forward_backward requests, up to this many tokens, in one pass over the
    # base (server.serving.joint_passes); 0: each runs alone.
    joint_pass_tokens: int = Field(32768, ge=0)
    header_timeout_s: float = Field(10.0, gt=0)  # a request's line and headers, from its first byte (408 after)
    body_timeout_s: float = Field(30.0, gt=0)  # a request body, from the end of its headers (408 after) ...
    min_body_rate: int = Field(16 << 10, ge=0)  # ... plus 1 s per this many bytes received; 0: no extension
    max_header_bytes: int = Field(64 << 10, ge=1024)  # a request's line and headers (431 above)
    # A worker call with no sign of life for this long has hung: the worker is killed and replaced.
    worker_timeout_s: float = Field(3600.0, gt=0)
    # Training models on the workers: a silent session's are parked (saved whole, freed) after
    # session_timeout_s; past max_resident_models the least recently used is parked; all are at
    # shutdown, within shutdown_timeout_s. A parked model comes back at its next request.
    session_timeout_s: float = Field(900.0, gt=0)
    max_resident_models: int | None = Field(64, ge=1)
    shutdown_timeout_s: float = Field(25.0, ge=0)
    # An fsspec URL (gs://bucket/prefix, file:///path) that every saved checkpoint is copied to,
    # and restored from on a disk that lacks it (server.mirror).
    checkpoint_mirror: str | None = None
    # Finished futures (and their payloads) are deleted this long after they finished.
    result_retention_s: float = Field(7 * 86400.0, gt=0)
    # Inference: the training backend's own sampler, or vLLM (launched here, or at inference_url).
    inference: Literal["embedded", "vllm"] = "embedded"
    inference_url: str | None = None  # an already running vLLM (implies inference="vllm")
    vllm_python: str | None = None  # the interpreter of the vLLM venv (hosted-tinker setup-vllm)
    vllm_gpus: str | None = None  # CUDA_VISIBLE_DEVICES for vLLM; None: the training devices
    vllm_args: list[str] = Field(default_factory=list)  # passed through to vLLM's server
    vllm_port: int = 0  # 0: any free port on 127.0.0.1
    vllm_max_loras: int = 4  # adapters vLLM batches together at once
    vllm_gpu_memory_utilization: float | None = None  # None: 0.45 when sharing a GPU with training
    max_lora_rank: int = 64  # vLLM reserves LoRA memory for this rank; larger ranks are refused
    # API keys besides those `hosted-tinker keys create` stores (see keys.py).
    api_keys_file: Path | None = None
    dev_any_key: bool = False  # development only: any tml- key is accepted, each its own tenant
    public_docs: bool = False  # /docs and /openapi.json without a key (with keys on; open servers show them anyway)
    public_metrics: bool = False  # /metrics without a key (its per-model series still need an operator's)
    # Key ids (``keys list``) that see the whole server: the console's server page
    # (server.console), every model's series in /metrics (``ServerState.is_operator``).
    console_operators: list[str] = Field(default_factory=list)
    # The limits every key is held to unless it has its own (``server.quotas.Limits``; --key-limit).
    key_limits: dict[str, Any] = Field(default_factory=dict)
    # One JSON line per request (``server.api.request_log``): a file, "-" for stderr; None: the
    # data directory's requests.jsonl.
    request_log: str | None = None
    # Lines a second of requests without a valid key (and of a key's 429s for its rate), in bursts
    # of a minute's worth; the others are counted in one summary line a minute. 0: summaries only.
    request_log_anonymous_per_s: float = Field(1.0, ge=0)
    # uvicorn's access log (on stderr, with the server's log): off, the request log is the record.
    access_log: bool = False

    def request_log_target(self) -> str:
        return self.request_log if self.request_log is not None else str(self.data_dir / "requests.jsonl")

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, rank: int) -> int:
        if rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {sorted(VLLM_LORA_RANKS)} (vLLM's sizes), got {rank}")
        return rank

    @model_validator(mode="after")
    def _one_body_fits(self) -> ServerConfig:
        if self.max_inflight_body_bytes < 3 * self.max_body_bytes:
            raise ValueError(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must hold one largest body as it is "
                f"read (twice) and inflated: at least 3 x max_body_bytes ({3 * self.max_body_bytes})"
            )
        return self

    @model_validator(mode="after")
    def _devices_parse(self) -> ServerConfig:
        self.training_devices()  # raises on a malformed spec; whether they fit is the plan's (``Options.check``)
        return self

    def training_devices(self) -> list[str]:
        """One device per training rank of this node."""
        return parse_devices(self.train_devices) if self.train_devices is not None else [self.device]

    def rank_devices(self) -> list[str]:
        """One device per training rank of every node, by global rank: each node has the same."""
        return self.training_devices() * self.nnodes

    @property
    def uses_vllm(self) -> bool:
        return self.inference == "vllm" or self.inference_url is not None

    def vllm_shares_training_gpu(self, inherited_visible: str | None) -> bool:
        """Whether a vLLM this server launches runs on a GPU a training rank of this node holds:
        by default it takes rank 0's; given ``vllm_gpus``, whether they name one (as this
        process's ``CUDA_VISIBLE_DEVICES``, ``inherited_visible``, numbers the ranks' GPUs)."""
        gpus = [d for d in self.training_devices() if d.startswith("cuda")]
        if self.inference_url is not None or self.inference != "vllm" or not gpus:
            return False
        if self.vllm_gpus is None:
            return True
        named = {gpu.strip() for gpu in self.vllm_gpus.split(",")}
        return any(visible_gpu(d, inherited_visible) in named for d in gpus)

    def model_path(self) -> str:
        """The local directory or hub id to load; builds the tiny model on first use."""
        if self.model is not None:  # a folder by its absolute path: ranks on other nodes start elsewhere
            local = Path(self.model).expanduser()
            return str(local.resolve()) if local.is_dir() else self.model
        from hosted_tinker.core.tiny_model import build_tiny_model

        return str(build_tiny_model(self.data_dir / "models" / "tiny-qwen3").resolve())

    def served_names(self) -> list[str]:
        primary = self.model if self.model is not None else TINY_MODEL_NAME
        return list(dict.fromkeys([primary, *self.model_names]))
