"""What an adapter upload must hold: the files ``save_weights_external`` writes for a base model
and LoRA shape (``Layout``, read from such an export), and the check of uploaded files against
it. Pure functions over bytes; every refusal is a ``CheckpointError`` naming the file and what
in it differs, so that an upload is refused before anything of it is stored.

A ``safetensors`` file is an 8-byte little-endian header length, a JSON header
``{tensor: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` and the tensors' bytes;
the header is read without the tensors, so the tensor names, shapes and dtypes are checked
before the file is decoded at all.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from hosted_tinker.core.checkpoints import CONFIG, WEIGHTS, CheckpointError

MAX_CONFIG_BYTES = 1 << 20  # an export's config lists every target module: ~40 KB for 64 layers
METADATA = "__metadata__"
# The adapter_config.json fields that change what the tensors mean (the others are PEFT's
# bookkeeping: its version, revision, inference_mode ...). An upload may leave one out, as long
# as what it says is what the export says.
MEANING = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "bias",
    "fan_in_fan_out",
    "lora_bias",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "use_qalora",
)


@dataclass(frozen=True)
class Tensor:
    dtype: str  # safetensors' name: "F32", "BF16" ...
    shape: tuple[int, ...]


ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
HEADER_SLACK = 64 << 10  # room in a header for metadata, white space, another order of its tensors


@dataclass(frozen=True)
class Layout:
    """An export's files: its config (Tinker's module names), its tensors, each file's size and
    the length of its safetensors header."""

    config: dict
    tensors: dict[str, Tensor]
    sizes: dict[str, int]
    header_bytes: int

    @classmethod
    def of_export(cls, files: dict[str, bytes]) -> Layout:
        (header_bytes,) = struct.unpack("<Q", files[WEIGHTS][:8])
        return cls(
            json.loads(files[CONFIG]),
            safetensors_header(files[WEIGHTS], WEIGHTS),
            {name: len(data) for name, data in files.items()},
            header_bytes,
        )

    @classmethod
    def at_rank(cls, one: Layout, two: Layout, rank: int) -> Layout:
        """The layout of an export at ``rank``, from exports of the same adapter at ranks 1 and 2:
        in each tensor the axis that grew is the rank's, and the config differs only in ``r``
        (so one export per kind of adapter tells every rank's, without making each on the worker)."""
        if set(one.tensors) != set(two.tensors) or {k for k in two.config if one.config.get(k) != two.config[k]} != {
            "r"
        }:
            raise ValueError("exports at ranks 1 and 2 differ in more than their rank")
        tensors = {}
        for key, small in one.tensors.items():
            grown = [i for i, (a, b) in enumerate(zip(small.shape, two.tensors[key].shape, strict=True)) if a != b]
            if len(grown) != 1 or small.shape[grown[0]] != 1:
                raise ValueError(f"tensor {key} does not have one rank axis")
            shape = list(small.shape)
            shape[grown[0]] = rank
            tensors[key] = Tensor(small.dtype, tuple(shape))
        data = sum(math.prod(t.shape) * ITEM_BYTES[t.dtype] for t in tensors.values())
        header = two.header_bytes + 8 * len(tensors)  # each of its numbers a few digits longer
        config = two.config | {"r": rank}
        sizes = {CONFIG: len(json.dumps(config, indent=2)), WEIGHTS: 8 + header + data}
        return cls(config, tensors, sizes, header)

    @property
    def max_header(self) -> int:
        return 2 * self.header_bytes + HEADER_SLACK

    def max_bytes(self, name: str) -> int:
        """The most an upload of file ``name`` may hold: the export's size, with room for a
        header that carries metadata or names its tensors in another order."""
        if name == CONFIG:
            return MAX_CONFIG_BYTES
        return self.sizes[name] - self.header_bytes + self.max_header


def safetensors_header(data: bytes, name: str, max_header: int | None = None) -> dict[str, Tensor]:
    """The tensors a ``safetensors`` file declares, from its header alone, checked to be one:
    a header of at most ``max_header`` bytes (parsed JSON takes several times its size) that
    parses, entries with a dtype, a shape and offsets that tile the data exactly."""
    if len(data) < 8:
        raise CheckpointError(f"{name} is not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise CheckpointError(f"{name} is not a safetensors file (its header is longer than the file)")
    if max_header is not None and size > max_header:
        raise CheckpointError(f"{name}: its header of {size} bytes is larger than this adapter's can be ({max_header})")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, RecursionError):
        raise CheckpointError(f"{name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name} is not a safetensors file (its header is not an object)")
    tensors, spans = {}, []
    for key, entry in header.items():
        if key == METADATA:
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list) and all(map(_count, [*shape, start, end]))):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name}: tensor {key!r} has no valid dtype, shape and data_offsets") from None
        tensors[key] = Tensor(dtype, tuple(shape))
        spans.append((start, end))
    data_bytes = len(data) - 8 - size
    at = 0
    for start, end in sorted(spans):
        if start != at or end < start:
            raise CheckpointError(f"{name}: the tensors' data_offsets overlap or leave gaps")
        at = end
    if at != data_bytes:
        raise CheckpointError(f"{name}: the tensors' data_offsets do not cover the file's {data_bytes} data bytes")
    return tensors


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_upload(layout: Layout, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The uploaded adapter's tensors, if ``files`` are what an export of ``layout``'s shape
    holds: the same files, a config that means the same adapter, the same tensor names (Tinker's),
    each of the same shape and dtype, every value finite."""
    for name in layout.sizes:
        if name not in files:
            raise CheckpointError(f"file {name} was not uploaded")
    check_config(layout.config, files[CONFIG])
    tensors = safetensors_header(files[WEIGHTS], WEIGHTS, layout.max_header)
    missing = sorted(set(layout.tensors) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{WEIGHTS} has no tensor {missing[0]!r}{more}, which this adapter holds")
    foreign = sorted(set(tensors) - set(layout.tensors))
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise CheckpointError(f"{WEIGHTS}: tensor {foreign[0]!r}{more} is not one this adapter holds")
    for key, expected in layout.tensors.items():
        got = tensors[key]
        if got.shape != expected.shape:
            raise CheckpointError(f"{WEIGHTS}: tensor {key!r} has shape {list(got.shape)}, not {list(expected.shape)}")
        if got.dtype != expected.dtype:
            raise CheckpointError(f"{WEIGHTS}: tensor {key!r} is {got.dtype}, not {expected.dtype}")
    try:
        weights = load_safetensors(files[WEIGHTS])
    except Exception as e:  # the header held, the library still refuses: say so, never a 500
        raise CheckpointError(f"{WEIGHTS} could not be read: {e}") from None
    for key, value in weights.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise CheckpointError(f"{WEIGHTS}: tensor {key!r} holds a NaN or an infinity")
    return weights


def check_config(expected: dict, data: bytes) -> None:
    """``data`` is an ``adapter_config.json`` that means the adapter ``expected`` describes."""
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{CONFIG} is not JSON") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{CONFIG} is not a JSON object")
    for field in MEANING:
        if field in config and not _same(config[field], expected.get(field)):
            raise CheckpointError(
                f"{CONFIG}: {field} is {_shown(config[field])}, but this adapter has {_shown(expected.get(field))}"
            )
    modules = config.get("target_modules")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise CheckpointError(f"{CONFIG}: target_modules must be the list of module names the adapter wraps")
    if set(modules) != set(expected["target_modules"]):
        unknown = sorted(set(modules) - set(expected["target_modules"]))
        left = sorted(set(expected["target_modules"]) - set(modules))
        detail = f"{unknown[0]!r} is not one of this adapter's" if unknown else f"{left[0]!r} is missing"
        raise CheckpointError(f"{CONFIG}: target_modules differ from this adapter's: {detail}")


def _same(got: object, expected: object) -> bool:
    """Equal as PEFT reads them: an absent, null, false or empty setting is the default."""
    if _unset(got) or _unset(expected):
        return _unset(got) and _unset(expected)
    if isinstance(got, int | float) and isinstance(expected, int | float) and not isinstance(got, bool):
        try:
            return math.isclose(got, expected)
        except OverflowError:  # an integer past what a float holds: not this adapter's
            return False
    return got == expected


def _unset(value: object) -> bool:
    return value is None or value is False or value == {} or value == []


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
