"""The unit tests of what tests/e2e/test_megatron.py tests end to end (no server here)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast


def test_layers_auto_picks_transformer_engine_for_16_bit_gpu_ranks_only(monkeypatch) -> None:
    from hosted_tinker.rank.plans import options

    monkeypatch.setattr(options, "has_transformer_engine", lambda: True)
    auto = options.MegatronOptions(tp=1)
    assert auto.uses_te("cuda:0", "bfloat16") and auto.uses_te("cuda:1", "float16")
    assert not auto.uses_te("cuda:0", "float32") and not auto.uses_te("cpu", "bfloat16")
    assert options.MegatronOptions(tp=1, layers="te").uses_te("cuda:0", "float32")  # asked for: as asked
    assert not options.MegatronOptions(tp=1, layers="local").uses_te("cuda:0", "bfloat16")
    monkeypatch.setattr(options, "has_transformer_engine", lambda: False)
    assert not auto.uses_te("cuda:0", "bfloat16")


def test_a_megatron_core_it_was_not_built_on_is_refused_at_start_up(monkeypatch) -> None:
    """pip gives Python 3.12 the newest megatron-core, whose layer specs rank.mcore cannot read:
    the start is refused, naming the installed release and the pip command, not a rank's traceback."""
    from hosted_tinker.rank.plans import options, plan_options

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.19.2")
    with pytest.raises(ValueError, match=r"not the installed 0\.19\.2: pip install 'megatron-core<0\.17,>=0\.16\.1'"):
        plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0)
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.16.1")
    assert plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0).tp == 2

    def not_installed(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(options.importlib.metadata, "version", not_installed)  # a Megatron-LM checkout
    with pytest.raises(ValueError, match="importable but no megatron-core package is installed"):
        plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0)


def test_the_pins_are_the_ones_pyproject_installs() -> None:
    """One release of each engine, said twice (pyproject's extras, and where the code checks or
    installs it): the two must not drift apart."""
    import tomllib

    from packaging.requirements import Requirement

    from hosted_tinker.inference.vllm_setup import VLLM_CUDA_SPEC
    from hosted_tinker.rank.plans.options import MCORE_SUPPORTED

    extras = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert Requirement(extras["megatron"][0]).specifier == MCORE_SUPPORTED
    assert Requirement(extras["vllm"][0]) == Requirement(VLLM_CUDA_SPEC)


def test_expert_parallelism_is_checked_before_a_rank_starts_or_as_the_model_loads(monkeypatch, tiny_model_dir) -> None:
    """ep and tp must each divide the ranks (the experts are not split over tp's ranks); ep takes
    the token threshold (a memory budget is measured per rank, on passes of unequal length), needs
    a model with routed experts, and with tp > 1 sequence parallelism: said in one line (what
    `serve` prints), as the rest of the megatron options."""
    from hosted_tinker.rank.mcore.convert import HfShape
    from hosted_tinker.rank.plans import options, plan_options

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.16.1")
    with pytest.raises(ValueError, match=r"ep=4 does not divide the 2 ranks of --train-devices"):
        plan_options("megatron", {"tp": "2", "ep": "4"}, ["cpu"] * 2, 3600.0)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 ranks of --train-devices"):
        plan_options("megatron", {"tp": "4", "ep": "2"}, ["cpu"] * 2, 3600.0)
    plan_options("megatron", {"tp": "2", "ep": "4", "sequence_parallel": "true"}, ["cpu"] * 4, 3600.0)
    with pytest.raises(ValueError, match=r"tp=2 and ep=3: one must divide the other"):
        plan_options("megatron", {"tp": "2", "ep": "3", "sequence_parallel": "true"}, ["cpu"] * 6, 3600.0)
    with pytest.raises(ValueError, match=r"activation_memory_gib is not built for ep > 1"):
        plan_options("megatron", {"ep": "2", "activation_memory_gib": "1"}, ["cpu"] * 2, 3600.0)
    assert plan_options("megatron", {"ep": "2"}, ["cuda:0", "cuda:1"], 3600.0).activation_budget(["cuda:0"]) is None
    with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model; Qwen3ForCausalLM has no experts"):
        HfShape.read(str(tiny_model_dir)).check_ep(2)
    moe = dataclasses.replace(HfShape.read(str(tiny_model_dir)), arch="Qwen3MoeForCausalLM", experts=8)
    moe.check_ep(4)  # two experts a rank
    with pytest.raises(ValueError, match=r"ep=3 does not divide the model's 8 routed experts"):
        moe.check_ep(3)
    with pytest.raises(ValueError, match=r"tp=2 on a mixture-of-experts model needs sequence_parallel=true"):
        moe.check_ep(2, tp=2)
    moe.check_ep(2, tp=2, sequence_parallel=True)
    moe.check_ep(1, tp=2, sequence_parallel=True)
