"""Images in a ``ModelInput`` (the SDK's ``ImageChunk``): what one is, and opening one safely.

An image stands in a sequence as a run of placeholder tokens (the model's ``image_token_id``),
as many as its processor makes of it; the rank's vision tower turns the encoded bytes into the
embeddings those positions take (``rank.vision``). The server opens only the header (to count
tokens before any compute), the rank decodes the pixels; both through ``open_image``, which
refuses an image larger than ``MAX_IMAGE_PIXELS`` before decoding it (a 50 KB PNG can declare
a 60,000² canvas: decompressed, 10 GiB).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from hosted_tinker.core.errors import UserError

# The formats the SDK's ImageChunk names, as Pillow names them.
FORMATS = {"png": "PNG", "jpeg": "JPEG"}
# Per image, decoded (width × height): 8K × 4K. Qwen3.5's processor resizes to at most 16 M pixels.
MAX_IMAGE_PIXELS = 1 << 25
# Per request, decoded, over all its images: what one call may make a rank decode.
MAX_REQUEST_PIXELS = 1 << 28


@dataclass(frozen=True)
class ImageInput:
    """One image of a sequence.

    start   the position of its first placeholder token in the sequence
    tokens  how many placeholder tokens it takes (its processor's count)
    data    the encoded image (png or jpeg bytes)
    format  ``png`` or ``jpeg`` (``FORMATS``)
    size    (width, height) to resize it to before processing (the chunk's
            ``override_dimensions``), or None: its own size
    """

    start: int
    tokens: int
    data: bytes
    format: str
    size: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.tokens


def open_image(data: bytes, fmt: str, where: str):
    """The PIL image in ``data`` (only its header read so far), checked against its declared
    format and ``MAX_IMAGE_PIXELS``; a ``UserError`` naming ``where`` otherwise."""
    from PIL import Image

    if fmt not in FORMATS:
        raise UserError(f"{where}.format is {fmt!r}; an image is one of {sorted(FORMATS)}")
    if not data:
        raise UserError(f"{where}.data is empty")
    try:
        image = Image.open(io.BytesIO(data), formats=[FORMATS[fmt]])
    except Image.DecompressionBombError:  # PIL's own bound (twice its MAX_IMAGE_PIXELS), past ours
        raise UserError(f"{where}: the image is over {MAX_IMAGE_PIXELS} pixels") from None
    except Exception as e:  # PIL raises many kinds for bytes that are not an image of this format
        raise UserError(f"{where}.data is not a {fmt} image ({type(e).__name__}: {e})") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise UserError(f"{where}: a {width}×{height} image; at most {MAX_IMAGE_PIXELS} pixels are taken")
    return image


def pixels(image: ImageInput, where: str):
    """The image decoded to RGB (resized to ``image.size`` if it names one)."""
    from PIL import Image

    opened = open_image(image.data, image.format, where)
    try:
        rgb = opened.convert("RGB")  # decodes: bounded by the size checked above
    except Exception as e:  # a header that promised more than the data holds
        raise UserError(f"{where}.data: the {image.format} image does not decode ({type(e).__name__}: {e})") from None
    if image.size is not None and image.size != rgb.size:
        rgb = rgb.resize(image.size, Image.Resampling.BICUBIC)
    return rgb
