"""Images for tests: a random PNG, and a datum of text and images as a rank takes it
(``core.images``), each image wrapped in Qwen3.5's vision start/end tokens as its chat
template lays it."""

from __future__ import annotations

import io

import numpy as np
import torch

from hosted_tinker.core.images import ImageInput
from hosted_tinker.core.types import DatumInput


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_datum(config, processor, texts: list[list[int]], images: list[bytes]) -> DatumInput:
    """``texts[0]``, image 0, ``texts[1]``, image 1, …, ``texts[-1]`` under a vision-language
    ``config`` and its image ``processor``; targets: the next token, weights 1."""
    from PIL import Image

    merge = processor.merge_size
    tokens: list[int] = []
    laid: list[ImageInput] = []
    for i, text in enumerate(texts):
        tokens += text
        if i < len(images):
            width, height = Image.open(io.BytesIO(images[i])).size
            count = processor.get_number_of_image_patches(height, width, {}) // merge**2
            tokens.append(config.vision_start_token_id)
            laid.append(ImageInput(len(tokens), count, images[i], "png"))
            tokens += [config.image_token_id] * count
            tokens.append(config.vision_end_token_id)
    ids = torch.tensor(tokens)
    return DatumInput(ids, torch.roll(ids, -1), {"weights": torch.ones(len(ids))}, tuple(laid))
