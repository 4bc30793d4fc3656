"""Images of a request laid into its sequence before anything queues: each ``ImageChunk``
counted by the served model's own processor (from the image's header alone), checked against
the ``expected_tokens`` the SDK sent, and given its run of placeholder tokens.

The count must be the one the rank's processor makes of the pixels (``rank.vision``): both are
the checkpoint's ``AutoImageProcessor``, here asked only for the number
(``get_number_of_image_patches``), there for the patches.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from hosted_tinker.core.errors import UserError, bad_request
from hosted_tinker.core.images import MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS, ImageInput, open_image
from hosted_tinker.core.pretrained import auto_image_processor
from hosted_tinker.core.types import Capabilities
from hosted_tinker.server.protocol.proto_codec import WireDatum, WireImage


class ImageTokens:
    """How many placeholder tokens the served model makes of an image of a given size."""

    def __init__(self, model_path: str, image_token_id: int) -> None:
        self.processor = auto_image_processor(model_path)
        self.merge = int(getattr(self.processor, "merge_size", 1))
        self.image_token_id = image_token_id

    def count(self, width: int, height: int, where: str) -> int:
        try:
            patches = self.processor.get_number_of_image_patches(height, width, {})
        except ValueError as e:  # e.g. an aspect ratio over 200, which the processor refuses
            raise bad_request(f"{where}: a {width}×{height} image is refused by the model's processor: {e}") from None
        return int(patches) // self.merge**2


class ImageLayout:
    """Lays images into sequences for one served model (``None`` counter: it takes none)."""

    def __init__(self, caps: Capabilities, counter: ImageTokens | None) -> None:
        self.caps, self.counter = caps, counter

    def image(self, image: WireImage, start: int, where: str, budget: list[int]) -> ImageInput:
        """``image`` (``where`` names its chunk) placed at ``start``: its size read from the header,
        its token count, the SDK's ``expected_tokens`` held to it; ``budget``: the pixels the
        request may still decode, less this image's."""
        counter = self.image_tokens(where)
        try:
            opened = open_image(image.data, image.format, where)
        except UserError as e:
            raise bad_request(str(e)) from None
        width, height = opened.size
        size = image.size
        if size is not None:  # the rank resizes to it before processing (``core.images.pixels``)
            w, h = size
            if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
                raise bad_request(f"{where}.override_dimensions {w}×{h}: at most {MAX_IMAGE_PIXELS} pixels")
        budget[0] -= width * height + (size[0] * size[1] if size else 0)
        if budget[0] < 0:
            raise bad_request(f"{where}: the request's images hold over {MAX_REQUEST_PIXELS} pixels in all")
        if size is not None:
            width, height = size
        tokens = counter.count(width, height, where)
        if image.expected_tokens is not None and image.expected_tokens != tokens:
            raise bad_request(
                f"{where}: the {width}×{height} {image.format} image is {tokens} tokens for this model, "
                f"but expected_tokens says {image.expected_tokens}"
            )
        return ImageInput(start, tokens, image.data, image.format, size)

    def image_tokens(self, where: str) -> ImageTokens:
        """The served model's image tokens; a 400 naming ``where`` if it takes no images."""
        if self.counter is None:
            raise bad_request(f"{where}: image chunks are not supported by {self.caps.arch} (a text-only model)")
        return self.counter

    def data(self, data: list[WireDatum]) -> None:
        """Lay each datum's images into its tokens (each a run of the model's image token)."""
        budget = [MAX_REQUEST_PIXELS]
        for i, d in enumerate(data):
            if d.chunks:
                self._datum(d, f"data[{i}]", budget)

    def _datum(self, d: WireDatum, where: str, budget: list[int]) -> None:
        pieces: list[np.ndarray] = []
        start = 0
        for chunk in d.chunks:
            if isinstance(chunk, WireImage):
                image = self.image(chunk, start, f"{where}.model_input[{chunk.chunk}]", budget)
                d.images.append(image)
                token = self.image_tokens(where).image_token_id  # (image() checked it)
                pieces.append(np.full(image.tokens, token, dtype=np.int64))
            else:
                pieces.append(chunk.astype(np.int64))
            start += len(pieces[-1])
        d.tokens = np.concatenate(pieces)
        d.chunks = []

    def prompt_image(self, chunk: dict, start: int, where: str, budget: list[int]) -> ImageInput:
        """A sampling prompt's JSON image chunk (``{"data": base64, "format", "expected_tokens"?}``)."""
        self.image_tokens(where)  # before its fields: a text-only model takes none
        data, fmt, expected = chunk.get("data"), chunk.get("format"), chunk.get("expected_tokens")
        if not isinstance(data, str):
            raise bad_request(f"{where}.data must be a base64 string")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}.data is not base64") from None
        if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 0):
            raise bad_request(f"{where}.expected_tokens must be a non-negative integer")
        if not isinstance(fmt, str):
            raise bad_request(f"{where}.format must be 'png' or 'jpeg'")
        return self.image(WireImage(0, raw, fmt, expected, None), start, where, budget)
