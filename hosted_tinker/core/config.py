"""The server's settings, each declared once: a ``ServerConfig`` field with its ``Flag`` (help, group), from
which the CLI makes its flags and ``settings`` the variables, the config file's keys and the docs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

TINY_MODEL_NAME = "hosted-tinker/tiny-qwen3"

VLLM_LORA_RANKS = {1, 8, 16, 32, 64, 128, 256, 320, 512}  # the --max-lora-rank values vLLM accepts
CLUSTER_KEY_ENV = "HOSTED_TINKER_CLUSTER_KEY"


def built_in_model_dir(data_dir: Path) -> Path:
    """Where a server with no --model builds the tiny model (once: it is kept there)."""
    return data_dir / "models" / "tiny-qwen3"


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


# The --help groups of serve's flags (None: the first, unnamed one).
NODES = "several machines (ddp, megatron): this server is node 0"
RESIDENT = "training models on the workers"
SLOW = "slow and oversized clients"
KEYS = "API keys (besides `hosted-tinker keys create`)"
ENGINE = "inference engine"


@dataclass(frozen=True)
class Flag:
    """How ``hosted-tinker serve`` sets a ``ServerConfig`` field, said with the field: its help
    and --help group, and its flag's name where that is not the field's (``--model-name`` for
    ``model_names``, ``--sample-batch-window-ms`` for ``sample_batch_window_s``: the CLI says
    how such a flag's value becomes the field's). The flag's type, default and choices are the
    field's; from the flags come the environment variables, the config file's keys,
    ``deploy/hosted-tinker.env.example`` and ``docs/configuration.md`` (``settings``)."""

    help: str
    group: str | None = None
    name: str | None = None  # default: the field's, less a seconds field's ``_s``, with dashes
    metavar: str | None = None

    def flag(self, field: str) -> str:
        return f"--{self.name or field.removesuffix('_s').replace('_', '-')}"


class ServerConfig(BaseModel):
    model: Annotated[str | None, Flag("HF id or local dir (default: the built-in tiny model)")] = None
    model_names: Annotated[list[str], Flag("another name the model answers to", name="model-name")] = Field(
        default_factory=list
    )
    # What get_info reports for the SDK's get_tokenizer(): by default the model's path or hub id,
    # which a client on another machine can load only if it has the same path or hub access.
    tokenizer_id: Annotated[
        str | None,
        Flag(
            "the tokenizer get_info names for the SDK's TrainingClient.get_tokenizer() (default: --model, whose "
            "local path loads only on this machine)"
        ),
    ] = None
    # loopback unless asked: the API is open until a key is configured
    host: Annotated[str, Flag("address to listen on (a public one needs keys)")] = "127.0.0.1"
    port: Annotated[int, Flag("port to listen on")] = 8000
    data_dir: Annotated[Path, Flag("SQLite, checkpoints, parked models, request log")] = Path("./hosted-tinker-data")
    # a key of rank.plans.PLANS (checked by the CLI's choices and at start-up)
    backend: Annotated[str, Flag("peft: one process; ddp: data parallel; megatron: tensor parallel")] = "peft"
    device: Annotated[str, Flag("cpu, cuda or cuda:N (the peft backend's device)")] = "cpu"
    # Data parallel: a device per rank, "cpu:2" or "cuda:0,1" (parse_devices).
    train_devices: Annotated[
        str | None, Flag("a device per rank, on every node: cpu:N or cuda:0,1,... (ddp, megatron)")
    ] = None
    # checked by rank.plans.backend_options
    backend_options: Annotated[
        dict[str, str],
        Flag(
            "a backend option (repeatable; `hosted-tinker backends` lists them)",
            name="backend-option",
            metavar="KEY=VALUE",
        ),
    ] = Field(default_factory=dict)
    # Several machines: this server is node 0 of ``nnodes``, each with the devices above; the
    # other nodes' agents (``hosted-tinker node``) connect to master_addr:master_port.
    nnodes: Annotated[int, Flag("machines in all, node 0 included ($NNODES)", group=NODES)] = Field(1, ge=1)
    master_addr: Annotated[str, Flag("node 0's address as the other nodes reach it ($MASTER_ADDR)", group=NODES)] = (
        "127.0.0.1"
    )
    # 0: any free port (tests)
    master_port: Annotated[
        int, Flag("node 0's cluster port, where the other nodes connect ($MASTER_PORT)", group=NODES)
    ] = Field(29500, ge=0, le=65535)
    # else $HOSTED_TINKER_CLUSTER_KEY (read_cluster_key)
    cluster_key_file: Annotated[
        Path | None, Flag("the secret every node shares (default: $HOSTED_TINKER_CLUSTER_KEY)", group=NODES)
    ] = None
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Flag("the base model's dtype")] = "float32"
    lora_alpha: Annotated[float, Flag("LoRA's alpha (its scale is alpha / rank)")] = 32.0
    # The dtype of LoRA's products and of the update's sum (rank.adapters): float32 whatever the
    # base (PEFT's arithmetic over float32 adapters), or the base's (as under torch.autocast)
    lora_compute: Annotated[
        Literal["float32", "base"],
        Flag(
            "the dtype of LoRA's products: float32 (PEFT's over float32 adapters) or base (the base's, as under "
            "torch.autocast; adapters and optimizer state stay float32)"
        ),
    ] = "float32"
    max_seq_len: Annotated[int | None, Flag("longest sequence (default: the model's)")] = None
    # how long an idle sampler waits to gather a batch
    sample_batch_window_s: Annotated[
        float, Flag("how long an idle sampler gathers a batch", name="sample-batch-window-ms")
    ] = 0.01
    # The embedded sampler shares the training worker: a request's n * (prompt + max_tokens), the
    # positions its rows hold, is at most max_sample_tokens (400 above), and a run gives the
    # worker back after each sample_slice_s of decoding, so training and other keys' runs wait
    # for a slice, not for a whole run.
    max_sample_tokens: Annotated[
        int,
        Flag(
            "n * (prompt + max_tokens) of one request to the embedded sampler, which shares the training worker (400 "
            "above)"
        ),
    ] = Field(65536, ge=1)
    sample_slice_s: Annotated[
        float,
        Flag("seconds a sampling run decodes before it gives the worker to training and other runs"),
    ] = Field(0.1, ge=0)
    # long-poll cap of retrieve_future (the SDK times out at 45 s)
    poll_timeout_s: Annotated[float, Flag("long-poll cap of retrieve_future (s)")] = 30.0
    # ask the SDK to zstd-compress forward_backward bodies
    proto_compress: Annotated[bool, Flag("have the SDK zstd-compress fwd/bwd bodies")] = False
    # The SDK's transport, chosen by the server in client/config. Against this server (HTTP/1.1)
    # httpx answers a call ~5 ms sooner than pyqwest (benchmarks/overhead.py).
    sdk_transport: Annotated[Literal["httpx", "pyqwest"], Flag("HTTP stack the SDK should use")] = "httpx"
    # a request body, also once inflated (413 above)
    max_body_bytes: Annotated[int, Flag("largest body of forward_backward, after zstd (413 above)")] = Field(
        256 << 20, ge=1024
    )
    # The body of a control call (every route not declared large_body): sessions, saves, heartbeats.
    max_control_body_bytes: Annotated[
        int, Flag("largest body of every other call: sessions, models, saves, heartbeats (413 above)")
    ] = Field(1 << 20, ge=1024)
    # The body of a sampling or completion request (large_body("prompt")): a prompt and its
    # targets (~20 MB for 40K tokens with dense top-64 targets: raise it for longer contexts);
    # JSON, parsed off the event loop but for json.loads' own share (~12-50 ms per MiB).
    max_prompt_body_bytes: Annotated[
        int, Flag("largest body of sampling and completions (JSON prompts; at most --max-body-bytes; 413 above)")
    ] = Field(32 << 20, ge=1024)
    # Request bodies the API process holds at once, as received (twice: while it is read) and as
    # inflated (503 above; a key's share: quotas.Limits.body_bytes, 429 above; api.inflight); at
    # least one largest body, read and inflated.
    max_inflight_body_bytes: Annotated[
        int,
        Flag(
            "request bodies held at once, as read (twice) and inflated (503 above; a key's share: 429); at least 3 x "
            "--max-body-bytes"
        ),
    ] = Field(1 << 30, ge=1024)
    # accepted, unfinished requests over all models (429 above)
    max_pending: Annotated[int, Flag("accepted, unfinished requests (429 above)")] = Field(1024, ge=1)
    # the same per training model or sampling session
    max_pending_per_model: Annotated[int, Flag("the same, per model or sampler")] = Field(64, ge=1)
    # the forward_backward batches they hold (429 above)
    max_pending_bytes: Annotated[
        int, Flag("bytes of forward_backward batches those may hold, once inflated (429 above; one always fits)")
    ] = Field(4 << 30, ge=1)
    # Several models' forward_backward requests, up to this many tokens, in one pass over the
    # base (server.serving.joint_passes); 0: each runs alone.
    joint_pass_tokens: Annotated[
        int, Flag("tokens of several models' forward_backward requests run in one pass over the base (0: each alone)")
    ] = Field(32768, ge=0)
    # a request's line and headers, from its first byte (408 after)
    header_timeout_s: Annotated[
        float,
        Flag(
            "seconds a request's line and headers may take, from its first byte (408 after)",
            group=SLOW,
        ),
    ] = Field(10.0, gt=0)
    # a request body, from the end of its headers (408 after) ...
    body_timeout_s: Annotated[
        float,
        Flag(
            "seconds a request body may take from the end of its headers, plus --min-body-rate's (408 after)",
            group=SLOW,
        ),
    ] = Field(30.0, gt=0)
    # ... plus 1 s per this many bytes received; 0: no extension
    min_body_rate: Annotated[
        int, Flag("bytes/s: each this many body bytes received adds 1 s to --body-timeout (0: none)", group=SLOW)
    ] = Field(16 << 10, ge=0)
    # a request's line and headers (431 above)
    max_header_bytes: Annotated[int, Flag("largest request line and headers (431 above)", group=SLOW)] = Field(
        64 << 10, ge=1024
    )
    # A worker call with no sign of life for this long has hung: the worker is killed and replaced.
    worker_timeout_s: Annotated[
        float,
        Flag(
            "seconds a backend call may go without a sign of life before its worker is killed and replaced",
        ),
    ] = Field(3600.0, gt=0)
    # Training models on the workers: a silent session's are parked (saved whole, freed) after
    # session_timeout_s; past max_resident_models the least recently used is parked; all are at
    # shutdown, within shutdown_timeout_s. A parked model comes back at its next request.
    session_timeout_s: Annotated[
        float,
        Flag(
            "seconds without a heartbeat after which a session's models are parked (saved whole, freed)",
            group=RESIDENT,
        ),
    ] = Field(900.0, gt=0)
    max_resident_models: Annotated[
        int | None,
        Flag("models on the workers at once; past it the least recently used is parked (0: no limit)", group=RESIDENT),
    ] = Field(64, ge=1)
    shutdown_timeout_s: Annotated[
        float,
        Flag(
            "seconds the server may take at SIGTERM to park every model, so the next start serves them",
            group=RESIDENT,
        ),
    ] = Field(25.0, ge=0)
    # An fsspec URL (gs://bucket/prefix, file:///path) that every saved checkpoint is copied to,
    # and restored from on a disk that lacks it (server.mirror).
    checkpoint_mirror: Annotated[
        str | None,
        Flag(
            "copy every saved checkpoint to this fsspec URL (gs://bucket/prefix, file:///path) and restore from it",
            group=RESIDENT,
            metavar="URL",
        ),
    ] = None
    # Finished futures (and their payloads) are deleted this long after they finished.
    result_retention_s: Annotated[
        float, Flag("seconds a finished request's result stays retrievable (default: 7 days)")
    ] = Field(7 * 86400.0, gt=0)
    # Inference: the training backend's own sampler, or vLLM (launched here, or at inference_url).
    inference: Annotated[Literal["embedded", "vllm"], Flag("who samples (default: embedded)", group=ENGINE)] = (
        "embedded"
    )
    # an already running vLLM (implies inference="vllm")
    inference_url: Annotated[str | None, Flag("use this running vLLM server (implies vllm)", group=ENGINE)] = None
    # the interpreter of the vLLM venv (hosted-tinker setup-vllm)
    vllm_python: Annotated[str | None, Flag("python of the vLLM venv (see setup-vllm)", group=ENGINE)] = None
    # CUDA_VISIBLE_DEVICES for vLLM; None: the training devices
    vllm_gpus: Annotated[
        str | None, Flag("GPUs for vLLM, e.g. 1,2 (default: share the training GPU)", group=ENGINE)
    ] = None
    # passed through to vLLM's server
    vllm_args: Annotated[
        list[str], Flag("extra arguments for vLLM's server (repeatable, shell-split)", group=ENGINE, name="vllm-arg")
    ] = Field(default_factory=list)
    # 0: any free port on 127.0.0.1
    vllm_port: Annotated[int, Flag("vLLM's port on 127.0.0.1 (default: any free)", group=ENGINE)] = 0
    # adapters vLLM batches together at once
    vllm_max_loras: Annotated[int, Flag("adapters vLLM runs in one batch", group=ENGINE)] = 4
    # A mixture-of-experts model's routing from vLLM (its --enable-return-routed-experts), which
    # record_stability_info records for routing replay. Off unless asked: vLLM then answers every
    # request with its sampled tokens' experts, layers x top_k bytes a token (in base64), each
    # answer parsed here; a Qwen3-235B-A22B token's is 752 bytes, 30 times its id and log-prob.
    vllm_routing: Annotated[
        Literal["record", "off"],
        Flag(
            "record: vLLM returns each token's experts on a mixture-of-experts model, for routing replay, "
            "in every answer (layers x top_k bytes a sampled token); off: none (default)",
            group=ENGINE,
        ),
    ] = "off"
    # None: 0.45 when sharing a GPU with training
    vllm_gpu_memory_utilization: Annotated[
        float | None,
        Flag("vLLM's share of its GPUs (default: 0.45 when sharing the training GPU, else vLLM's)", group=ENGINE),
    ] = None
    # vLLM reserves LoRA memory for this rank; larger ranks are refused
    max_lora_rank: Annotated[int, Flag("largest LoRA rank vLLM must serve", group=ENGINE)] = 64
    # API keys besides those `hosted-tinker keys create` stores (see keys.py).
    api_keys_file: Annotated[Path | None, Flag("file with one tml- key per line", group=KEYS)] = None
    # development only: any tml- key is accepted, each its own tenant
    dev_any_key: Annotated[bool, Flag("development only: accept any tml- key, each its own tenant", group=KEYS)] = False
    # /docs and /openapi.json without a key (with keys on; open servers show them anyway)
    public_docs: Annotated[bool, Flag("serve /docs and /openapi.json without a key when keys are on", group=KEYS)] = (
        False
    )
    # /metrics without a key (its per-model series still need an operator's)
    public_metrics: Annotated[
        bool,
        Flag(
            "serve /metrics without a key when keys are on (every model's series still need an operator's key)",
            group=KEYS,
        ),
    ] = False
    # Key ids (``keys list``) that see the whole server: the console's server page
    # (server.console), every model's series in /metrics (``ServerState.is_operator``).
    console_operators: Annotated[
        list[str],
        Flag(
            "a key (its id, as `keys list` shows it) that sees the whole server: the console's server page, every "
            "model's series in /metrics",
            group=KEYS,
            name="console-operator",
            metavar="KEY_ID",
        ),
    ] = Field(default_factory=list)
    # The limits every key is held to unless it has its own (``server.quotas.Limits``; --key-limit).
    key_limits: Annotated[
        dict[str, Any],
        Flag(
            "a limit every key is held to unless it has its own (repeatable): sessions, models, adapter_bytes, "
            "lora_rank, metadata_bytes, checkpoint_bytes, requests_per_s, pending, pending_bytes, sample_tokens, "
            "body_bytes, custom_loss_bytes, record_bytes",
            group=KEYS,
            name="key-limit",
            metavar="NAME=VALUE",
        ),
    ] = Field(default_factory=dict)
    # One JSON line per request (``server.api.request_log``): a file, "-" for stderr; None: the
    # data directory's requests.jsonl.
    request_log: Annotated[
        str | None,
        Flag("one JSON line per request: a file (default: requests.jsonl in --data-dir, rotated) or - for stderr"),
    ] = None
    # Lines a second of requests without a valid key (and of a key's 429s for its rate), in bursts
    # of a minute's worth; the others are counted in one summary line a minute. 0: summaries only.
    request_log_anonymous_per_s: Annotated[
        float,
        Flag(
            "request log lines a second of requests without a valid key or over a key's rate (bursts of a minute's "
            "worth); the others are counted in a summary line a minute (0: summaries only)",
            name="request-log-anonymous-per-s",  # a rate: its _s stays
        ),
    ] = Field(1.0, ge=0)
    log_level: Annotated[str, Flag("the server log's level (debug, info, warning)")] = "info"
    # uvicorn's access log (on stderr, with the server's log): off, the request log is the record.
    access_log: Annotated[
        bool, Flag("also write uvicorn's access log to stderr, secrets left out (the request log is the record)")
    ] = False

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

        return str(build_tiny_model(built_in_model_dir(self.data_dir)).resolve())

    def served_names(self) -> list[str]:
        primary = self.model if self.model is not None else TINY_MODEL_NAME
        return list(dict.fromkeys([primary, *self.model_names]))
