"""A checkpoint that names code of its own is refused in one line (``core.pretrained``): Kimi-K2's
folders say ``model_type: kimi_k2`` and name a config class of their own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.pretrained import auto_config
from hosted_tinker.core.tiny_model import build_tiny_model

pytestmark = pytest.mark.fast

REMOTE_CONFIG = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3", hidden_size=64)


def remote(tiny: Path, to: Path, file: str, fields: dict) -> Path:
    shutil.copytree(tiny, to)
    data = json.loads((to / file).read_text())
    (to / file).write_text(json.dumps(data | fields))
    return to


def test_a_config_of_the_checkpoints_own_classes_is_refused_saying_so(tiny: Path, tmp_path: Path):
    kimi = remote(tiny, tmp_path / "kimi", "config.json", {"model_type": "kimi_k2", "auto_map": REMOTE_CONFIG})
    with pytest.raises(UserError, match="its config is code of the checkpoint's own .auto_map."):
        auto_config(str(kimi))
    assert auto_config(str(tiny)).model_type == "qwen3"
