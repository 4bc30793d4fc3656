"""``core.adapter_layout``: an upload's files checked against an export's layout, from the bytes
alone (the e2e test drives the same through the server)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as save_safetensors

from hosted_tinker.core.adapter_layout import CONFIG, WEIGHTS, Layout, check_config, check_upload, safetensors_header
from hosted_tinker.core.checkpoints import CheckpointError

pytestmark = pytest.mark.fast

A, B = (
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
)
TENSORS = {A: torch.randn(4, 16), B: torch.zeros(16, 4)}
CONFIG_JSON = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 32.0,
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "target_modules": ["model.layers.0.self_attn.q_proj"],
    "peft_version": "0.21.2",
}


def export(tensors: dict[str, torch.Tensor] = TENSORS, config: dict = CONFIG_JSON) -> dict[str, bytes]:
    return {CONFIG: json.dumps(config).encode(), WEIGHTS: save_safetensors(tensors)}


LAYOUT = Layout.of_export(export())


def raw(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_an_export_passes_as_it_is_and_in_another_tensor_order() -> None:
    weights = check_upload(LAYOUT, export())
    assert weights.keys() == TENSORS.keys() and weights[A].equal(TENSORS[A])
    reordered = export({B: TENSORS[B], A: TENSORS[A]})
    check_upload(LAYOUT, reordered)
    assert LAYOUT.max_bytes(WEIGHTS) > len(export()[WEIGHTS])


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        ({A: TENSORS[A]}, "has no tensor"),
        (TENSORS | {A.replace("q_proj", "k_proj"): torch.zeros(4, 16)}, "is not one this adapter holds"),
        (TENSORS | {A: torch.zeros(4, 15)}, "has shape [4, 15], not [4, 16]"),
        (TENSORS | {A: torch.zeros(4, 16, dtype=torch.bfloat16)}, "is BF16, not F32"),
        (TENSORS | {B: torch.full((16, 4), float("inf"))}, "NaN or an infinity"),
    ],
)
def test_tensors_that_are_not_the_adapters_are_named(tensors: dict, says: str) -> None:
    with pytest.raises(CheckpointError, match=None) as refused:
        check_upload(LAYOUT, export(tensors))
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"1234", "shorter than its header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header is longer than the file"),
        (struct.pack("<Q", 2) + b"{]", "not JSON"),
        (raw([1], b""), "not an object"),
        (raw({A: {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "no valid dtype"),
        (raw({A: {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "no valid dtype"),
        (raw({A: {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gaps"),
        (raw({A: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "do not cover"),
        (
            raw(
                {
                    A: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    B: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                },
                b"\0" * 4,
            ),
            "overlap",
        ),
    ],
)
def test_a_file_that_is_not_safetensors_is_refused_from_its_header(data: bytes, says: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        safetensors_header(data, WEIGHTS)
    assert says in str(refused.value)


def test_metadata_in_the_header_is_allowed() -> None:
    data = raw({"__metadata__": {"format": "pt"}, A: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    assert safetensors_header(data, WEIGHTS) == {A: safetensors_header(data, WEIGHTS)[A]}


@pytest.mark.parametrize(
    "config",
    [
        CONFIG_JSON,
        {k: v for k, v in CONFIG_JSON.items() if k not in ("bias", "use_dora", "modules_to_save", "peft_version")},
        CONFIG_JSON | {"lora_alpha": 32, "use_dora": None, "modules_to_save": [], "revision": "x"},
        CONFIG_JSON | {"target_modules": list(reversed(CONFIG_JSON["target_modules"]))},
    ],
)
def test_a_config_that_means_the_same_adapter_passes(config: dict) -> None:
    check_config(CONFIG_JSON, json.dumps(config).encode())


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (CONFIG_JSON | {"r": 8}, "r is 8, but this adapter has 4"),
        (CONFIG_JSON | {"lora_alpha": 16}, "lora_alpha is 16"),
        (CONFIG_JSON | {"bias": "all"}, "bias"),
        (CONFIG_JSON | {"use_dora": True}, "use_dora"),
        (CONFIG_JSON | {"use_rslora": True}, "use_rslora"),
        (CONFIG_JSON | {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        (CONFIG_JSON | {"target_modules": "q_proj"}, "target_modules must be the list"),
        (CONFIG_JSON | {"target_modules": ["model.layers.0.self_attn.k_proj"]}, "is not one of this adapter's"),
        (CONFIG_JSON | {"target_modules": []}, "is missing"),
        ({k: v for k, v in CONFIG_JSON.items() if k != "target_modules"}, "target_modules must be the list"),
    ],
)
def test_a_config_of_another_adapter_is_refused_naming_the_field(config: dict, says: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        check_config(CONFIG_JSON, json.dumps(config).encode())
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("data", "says"), [(b"[1]", "not a JSON object"), (b"{", "not JSON"), (b"[" * 100000, "not JSON")]
)
def test_a_config_that_is_not_an_object_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        check_config(CONFIG_JSON, data)
    assert says in str(refused.value)


def test_every_ranks_layout_follows_from_exports_at_ranks_1_and_2() -> None:
    def at(rank: int) -> dict[str, bytes]:
        tensors = {A: torch.zeros(rank, 16), B: torch.zeros(16, rank), "e.lora_A": torch.zeros(3, rank, 8)}
        return export(tensors, CONFIG_JSON | {"r": rank})

    one, two = Layout.of_export(at(1)), Layout.of_export(at(2))
    for rank in (1, 4, 64):
        made, real = Layout.at_rank(one, two, rank), Layout.of_export(at(rank))
        assert made.tensors == real.tensors and made.config == real.config
        assert made.sizes[WEIGHTS] >= real.sizes[WEIGHTS] and made.max_header >= real.header_bytes
        check_upload(made, at(rank))
    with pytest.raises(ValueError, match="differ in more than their rank"):
        Layout.at_rank(
            one, Layout.of_export(at(2) | {CONFIG: json.dumps(CONFIG_JSON | {"r": 2, "bias": "all"}).encode()}), 4
        )


def test_a_header_larger_than_the_adapters_is_refused_before_it_is_parsed() -> None:
    files = export()
    size = struct.unpack("<Q", files[WEIGHTS][:8])[0]
    padded = raw({"__metadata__": {"pad": "x" * (LAYOUT.max_header)}}, b"")
    with pytest.raises(CheckpointError, match="larger than this adapter's can be"):
        check_upload(LAYOUT, files | {WEIGHTS: padded})
    assert LAYOUT.header_bytes == size


@pytest.mark.parametrize("offsets", [[0, None], [True, 4], ["0", "4"], [0.0, 4.0]])
def test_offsets_that_are_not_counts_are_refused(offsets: list) -> None:
    with pytest.raises(CheckpointError, match="no valid dtype, shape and data_offsets"):
        safetensors_header(raw({A: {"dtype": "F32", "shape": [1], "data_offsets": offsets}}, b"\0" * 4), WEIGHTS)


def test_a_number_no_float_holds_is_another_adapters() -> None:
    with pytest.raises(CheckpointError, match="r is"):
        check_config(CONFIG_JSON, json.dumps(CONFIG_JSON | {"r": 10**400}).encode())
