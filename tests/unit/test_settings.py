"""Where ``serve`` takes its settings from (``hosted_tinker.settings``): a flag, then
``$HOSTED_TINKER_<NAME>``, then the ``--config`` TOML file, then the default, as
``serve --print-config`` shows; a wrong value names where it came from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hosted_tinker.cli import CONVERTED, build_parser, main, serve_parser
from hosted_tinker.core.config import ServerConfig
from hosted_tinker.settings import configuration_doc, env_example

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "hosted-tinker.env.example"
DOCS = ROOT / "docs" / "configuration.md"


def printed(capsys: pytest.CaptureFixture, *flags: str) -> dict:
    assert main(["serve", *flags, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.toml"
    config.write_text('port = 9001\nmax-body-bytes = 2048\nkey_limit = ["sessions=3"]\npublic_docs = true\n')
    monkeypatch.setenv("HOSTED_TINKER_PORT", "9002")
    monkeypatch.setenv("HOSTED_TINKER_KEY_LIMIT", "models=2, sessions=5")
    monkeypatch.setenv("HOSTED_TINKER_PUBLIC_METRICS", "yes")
    settings = printed(capsys, "--config", str(config), "--max-body-bytes", "4096")
    assert settings["max_body_bytes"] == 4096  # flag over file
    assert settings["port"] == 9002  # environment over file
    assert settings["key_limits"] == {"models": 2, "sessions": 5}  # a repeatable one, comma-separated
    assert settings["public_docs"] is True and settings["public_metrics"] is True
    assert settings["max_control_body_bytes"] == 1 << 20  # the default
    monkeypatch.setenv("HOSTED_TINKER_CONFIG", str(config))
    monkeypatch.delenv("HOSTED_TINKER_PORT")
    assert printed(capsys)["port"] == 9001  # the file named by the environment
    # Names are the flags' (--shutdown-timeout, whatever its dest); an empty variable is unset;
    # a repeatable flag on the command line replaces the list; an unknown variable is said.
    monkeypatch.setenv("HOSTED_TINKER_SHUTDOWN_TIMEOUT", "7")
    monkeypatch.setenv("HOSTED_TINKER_MAX_SEQ_LEN", "")
    monkeypatch.setenv("HOSTED_TINKER_SHUTDOWN_TIMOUT", "8")
    assert main(["serve", "--key-limit", "sessions=9", "--print-config"]) == 0
    out, err = capsys.readouterr()
    settings = json.loads(out)
    assert settings["shutdown_timeout_s"] == 7 and settings["max_seq_len"] is None
    assert settings["key_limits"] == {"sessions": 9}
    assert "$HOSTED_TINKER_SHUTDOWN_TIMOUT is not a setting" in err


@pytest.mark.parametrize(
    ("env", "file", "said"),
    [
        ({"HOSTED_TINKER_PORT": "eighty"}, "", "$HOSTED_TINKER_PORT: 'eighty' is not a valid int"),
        ({"HOSTED_TINKER_BACKEND": "tpu"}, "", "$HOSTED_TINKER_BACKEND: 'tpu' is not one of peft"),
        ({"HOSTED_TINKER_PUBLIC_DOCS": "maybe"}, "", "$HOSTED_TINKER_PUBLIC_DOCS='maybe': expected true or false"),
        ({}, "colour = 'blue'\n", "'colour' is not a setting of serve"),
        ({}, "public_docs = 'yes'\n", "public_docs in "),
        ({}, "port = [1, 2]\n", "port in "),
        ({}, "port = \n", "config file"),
    ],
)
def test_a_wrong_setting_stops_the_start_naming_where_it_came_from(tmp_path, monkeypatch, env, file, said):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags = []
    if file:
        (tmp_path / "c.toml").write_text(file)
        flags = ["--config", str(tmp_path / "c.toml")]
    with pytest.raises(SystemExit, match="invalid settings") as stopped:
        main(["serve", *flags, "--print-config"])
    assert said in str(stopped.value)


def test_the_environment_file_example_lists_every_setting(capsys):
    assert main(["serve", "--print-config", "env"]) == 0
    assert capsys.readouterr().out == env_example(serve_parser())
    assert EXAMPLE.read_text() == env_example(serve_parser()), (
        "run: hosted-tinker serve --print-config env > deploy/hosted-tinker.env.example"
    )


def test_the_deploy_files_name_only_real_settings():
    """The variables ``deploy/`` sets (Dockerfiles, startup.sh) are settings serve reads."""
    known = set(re.findall(r"HOSTED_TINKER_[A-Z_]+", env_example(serve_parser())))
    known |= {"HOSTED_TINKER_CLUSTER_KEY", "HOSTED_TINKER_API_KEYS"}  # read by keys.py and config.py
    deploy = EXAMPLE.parent
    for path in [deploy / "Dockerfile", deploy / "Dockerfile.cuda", deploy / "startup.sh"]:
        named = set(re.findall(r"HOSTED_TINKER_[A-Z_]+", path.read_text()))
        assert named and named <= known, f"{path.name}: {sorted(named - known)}"


def test_serve_has_a_flag_for_each_setting_and_nothing_else():
    """Each setting is declared once, as a ServerConfig field; the flags are made from them."""
    meta = {"help", "config", "print_config"}  # about the settings, not settings
    dests = {a.dest for a in serve_parser()._actions} - meta
    assert dests == set(ServerConfig.model_fields)
    cli = (ROOT / "hosted_tinker" / "cli.py").read_text()
    assert cli.count("add_argument(") < 20  # serve's come from the fields; the other commands' are few


def test_a_flag_in_other_units_sets_its_field_in_the_fields_units(capsys):
    """The flags of ``CONVERTED``: each default is the field's default, and a value converts."""
    defaults = printed(capsys)
    assert defaults == json.loads(ServerConfig().model_dump_json())
    given = printed(
        capsys,
        "--sample-batch-window-ms",
        "25",
        "--backend-option",
        "microbatch_tokens=64",
        "--vllm-arg",
        "--enforce-eager --seed 3",
        "--key-limit",
        "sessions=2",
        "--max-resident-models",
        "0",
    )
    assert given["sample_batch_window_s"] == 0.025 and given["backend_options"] == {"microbatch_tokens": "64"}
    assert given["vllm_args"] == ["--enforce-eager", "--seed", "3"] and given["key_limits"] == {"sessions": 2}
    assert given["max_resident_models"] is None and set(CONVERTED) <= set(given)


def test_the_node_command_takes_the_cluster_settings_as_serve_does(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29999")
    args = build_parser().parse_args(["node", "--node-rank", "1", "--nnodes", "2"])
    assert (args.nnodes, args.master_port, args.master_addr) == (2, 29999, "127.0.0.1")
    monkeypatch.setenv("NNODES", "0")  # a launcher's 0 is no value, as the flags always took it
    monkeypatch.setenv("MASTER_PORT", "0")
    args = build_parser().parse_args(["serve"])
    assert (args.nnodes, args.master_port) == (1, 29500)
    node_help = build_parser()._subparsers._group_actions[0].choices["node"].format_help()
    assert "the cluster: node 0's server" in node_help and "this server is node 0" not in node_help


def test_the_configuration_page_lists_every_setting(capsys):
    assert main(["serve", "--print-config", "docs"]) == 0
    assert capsys.readouterr().out == configuration_doc(serve_parser())
    assert DOCS.read_text() == configuration_doc(serve_parser()), (
        "run: hosted-tinker serve --print-config docs > docs/configuration.md"
    )
    flags = {a.option_strings[-1] for a in serve_parser()._actions if a.dest in ServerConfig.model_fields}
    assert len(flags) == len(ServerConfig.model_fields) and all(f"| `{flag}" in DOCS.read_text() for flag in flags)
