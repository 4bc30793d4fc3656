"""Where ``hosted-tinker serve`` takes its settings from; the first that has one wins:

1. a flag (``--max-body-bytes 1048576``);
2. an environment variable ``HOSTED_TINKER_<NAME>`` (``HOSTED_TINKER_MAX_BODY_BYTES=1048576``);
3. the TOML file of ``--config FILE`` or ``$HOSTED_TINKER_CONFIG`` (``max_body_bytes = 1048576``);
4. the built-in default.

A setting's name is its flag's, with underscores (``--shutdown-timeout``: ``shutdown_timeout``,
also ``shutdown-timeout`` in the file). A repeatable flag takes a list in the file and
comma-separated values in the environment (flags given on the command line replace that list);
a switch takes true/false (1/0, yes/no, on/off); an empty variable counts as unset.
``serve --print-config`` prints the result (``--print-config env``: every setting, as an
environment file; ``docs``: as the docs' configuration page). What the settings are is declared
once, with ``core.config.ServerConfig``'s fields; the CLI makes the flags from them, and this
module reads the flags. Used by the CLI only, before anything is started.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "HOSTED_TINKER_"
CONFIG_ENV = "HOSTED_TINKER_CONFIG"
NOT_SETTINGS = frozenset({"help", "config", "print_config"})
# Read elsewhere: the config file's own variable, and secrets that are not flags.
OTHER_VARIABLES = frozenset(
    {CONFIG_ENV, "HOSTED_TINKER_CLUSTER_KEY", "HOSTED_TINKER_API_KEYS"}
    # the tests':
    | {
        "HOSTED_TINKER_REQUIRE_VLLM",
        "HOSTED_TINKER_REQUIRE_CHROMIUM",
        "HOSTED_TINKER_CHROMIUM",
        "HOSTED_TINKER_SCREENSHOTS",
    }
)
ESCAPED_BAR = " \\| "  # a | inside a markdown table's cell
TRUE, FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off", ""})


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The settings of ``parser`` (its options), by name: the long flag's, with underscores."""
    return {
        a.option_strings[-1].lstrip("-").replace("-", "_"): a
        for a in parser._actions
        if a.option_strings and a.dest not in NOT_SETTINGS
    }


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def layered_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], config_file: str | Path | None
) -> dict[str, Any]:
    """What the environment and the config file set, as defaults for ``parser`` (the flags
    given on the command line still win). A ValueError names the variable or file at fault."""
    known = settings(parser)
    values: dict[str, Any] = {}  # by the flag's dest, as parse_args would set it
    if config_file is not None:
        try:
            table = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"config file {config_file}: {e}") from None
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"config file {config_file}: {key!r} is not a setting of serve (see serve --help)")
            values[known[name].dest] = _converted(known[name], value, f"{key} in {config_file}")
    for name, action in known.items():
        if raw := environ.get(env_name(name)):
            values[action.dest] = _converted(action, _from_env(action, raw, f"${env_name(name)}"), f"${env_name(name)}")
    unknown = {v for v in environ if v.startswith(ENV_PREFIX)} - {env_name(n) for n in known} - OTHER_VARIABLES
    for variable in sorted(unknown):
        print(f"warning: ${variable} is not a setting of serve (see serve --print-config env)", file=sys.stderr)
    return values


def _from_env(action: argparse.Action, raw: str, where: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if raw.strip().lower() not in TRUE | FALSE:
            raise ValueError(f"{where}={raw!r}: expected true or false")
        return raw.strip().lower() in TRUE
    if isinstance(action, argparse._AppendAction):
        return [item.strip() for item in raw.split(",") if item.strip()]
    return raw


def _converted(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag would have given it: its type applied, its choices checked."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item, where) for item in items]
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    if callable(action.type) and not isinstance(value, bool):  # (never a registered type's name here)
        try:
            value = action.type(str(value) if action.type is not float else value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {value!r} is not a valid {getattr(action.type, '__name__', 'value')}") from None
    elif not isinstance(value, str | int | float):
        raise ValueError(f"{where}: expected a single value, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "false"
    if isinstance(action, argparse._AppendAction) or action.default is None:
        return ""
    return str(action.default)


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """The settings of ``parser`` by --help group, the first (argparse's "options") as "server"."""
    known = settings(parser).values()
    return [
        (group.title if group.title and group.title != "options" else "server", actions)
        for group in parser._action_groups
        if (actions := [a for a in group._group_actions if a in known])
    ]


def _name(action: argparse.Action) -> str:
    return action.option_strings[-1].lstrip("-").replace("-", "_")


def configuration_doc(parser: argparse.ArgumentParser) -> str:
    """Every setting of ``parser`` as a page of the docs, a table per group (``docs/configuration.md``:
    ``serve --print-config docs`` writes it)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Written by `hosted-tinker serve --print-config docs > docs/configuration.md` from the settings'",
        "     declarations (hosted_tinker/core/config.py); tests/unit/test_settings.py keeps it current. -->",
        "",
        "Every setting of `hosted-tinker serve` is a flag, or an environment variable `HOSTED_TINKER_<NAME>`, or",
        "`name = value` in the TOML file of `--config FILE` (or `$HOSTED_TINKER_CONFIG`), in that order of",
        "precedence. Repeatable flags take lists in the file and comma-separated values in the environment;",
        "switches take true or false. `serve --print-config` prints the settings in effect;",
        "`deploy/hosted-tinker.env.example` is every setting as an environment file (`serve --print-config env`).",
        "`hosted-tinker backends` lists each backend's `--backend-option`s; `hosted-tinker make-tiny-model DIR",
        "--family ...` builds an offline test model; `hosted-tinker setup-vllm DIR` creates vLLM's environment.",
    ]
    for title, actions in _groups(parser):
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", "| flag | variable | default | |", "|---|---|---|---|"]
        for action in actions:
            flag = action.option_strings[-1] + (f" {action.metavar}" if action.metavar else "")
            choices = f" ({ESCAPED_BAR.join(map(str, action.choices))})" if action.choices else ""
            default = _default(action)
            help_text = (action.help or "").replace("|", ESCAPED_BAR.strip())
            default = f"`{default}`" if default else ""
            lines.append(f"| `{flag}` | `{env_name(_name(action))}` | {default} | {help_text}{choices} |")
    return "\n".join(lines) + "\n"


def env_example(parser: argparse.ArgumentParser) -> str:
    """Every setting of ``parser`` as a commented environment file, grouped as ``--help`` shows
    them (``deploy/hosted-tinker.env.example``: ``serve --print-config env`` writes it)."""
    lines = [
        "# Every setting of `hosted-tinker serve`, as an environment file (systemd EnvironmentFile=,",
        "# docker --env-file, compose env_file:). Uncomment what you change. A flag wins over the",
        "# variable, the variable over the --config file, that over the default. Repeatable",
        "# settings take comma-separated values; switches take true or false.",
        "# Written by `hosted-tinker serve --print-config env`; tests/unit/test_settings.py keeps it current.",
        "",
        f"# {CONFIG_ENV}=/etc/hosted-tinker/config.toml",
    ]
    for title, actions in _groups(parser):
        lines += ["", f"# ---- {title}"]
        for action in actions:
            lines += [f"# {action.help}", f"# {env_name(_name(action))}={_default(action)}"]
    return "\n".join(lines) + "\n"
