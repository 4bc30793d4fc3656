"""The server's side of images (``server.serving.images``, ``core.images``, the protobuf datum):
each image counted as the model's processor makes it, from its header alone; what is not an image,
or too large an image, or a count that is not the model's, refused by name before any compute."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core import images as core_images
from hosted_tinker.core.errors import ApiError
from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import Capabilities
from hosted_tinker.server.protocol.proto_codec import WireImage, _datum
from hosted_tinker.server.serving.images import ImageLayout, ImageTokens

pytestmark = pytest.mark.fast

CAPS = Capabilities(
    backend="peft", arch="Qwen3_5ForCausalLM", losses=(), max_seq_len=4096, max_tokens_per_batch=1 << 20, vocab_size=516
)


def encoded(width: int, height: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height), 7).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def counter(tmp_path_factory) -> ImageTokens:
    model = build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", family="qwen3_5", hidden_size=64)
    return ImageTokens(str(model), image_token_id=514)


@pytest.mark.parametrize("size", [(96, 64), (64, 96), (17, 300), (1000, 20), (31, 33), (640, 480)])
def test_the_count_is_what_the_processor_makes_of_the_pixels(counter: ImageTokens, size):
    from PIL import Image

    width, height = size
    made = counter.processor(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"]
    assert counter.count(width, height, "x") == int(made.prod()) // counter.merge**2


def layout(counter: ImageTokens | None = None) -> ImageLayout:
    return ImageLayout(CAPS, counter)


def test_an_image_is_laid_in_as_its_count_of_image_tokens(counter: ImageTokens):
    data = encoded(96, 64)
    count = counter.count(96, 64, "x")
    msg = pb.Datum()
    msg.model_input.add().encoded_text.tokens = np.array([5, 6], "<i4").tobytes()
    msg.model_input.add().image.CopyFrom(pb.ImageChunk(data=data, format="png", expected_tokens=count))
    msg.model_input.add().encoded_text.tokens = np.array([7], "<i4").tobytes()
    d = _datum(msg, 0, [1 << 20])
    layout(counter).data([d])
    assert d.tokens.tolist() == [5, 6, *[514] * count, 7]
    (image,) = d.images
    assert (image.start, image.tokens, image.data, image.format) == (2, count, data, "png")


def test_a_count_that_is_not_the_models_is_a_400_naming_the_chunk_and_both_counts(counter: ImageTokens):
    count = counter.count(96, 64, "x")
    with pytest.raises(ApiError) as refused:
        layout(counter).image(
            WireImage(3, encoded(96, 64), "png", count + 1, None), 0, "data[2].model_input[3]", [1 << 30]
        )
    assert refused.value.status == 400
    assert str(refused.value).startswith("data[2].model_input[3]")
    assert f"is {count} tokens" in str(refused.value) and f"expected_tokens says {count + 1}" in str(refused.value)


def test_override_dimensions_are_counted_and_kept_for_the_rank(counter: ImageTokens):
    image = layout(counter).image(WireImage(0, encoded(96, 64), "png", None, (200, 40)), 0, "x", [1 << 30])
    assert (image.tokens, image.size) == (counter.count(200, 40, "x"), (200, 40))
    assert core_images.pixels(image, "x").size == (200, 40)


@pytest.mark.parametrize(
    ("data", "fmt", "says"),
    [
        (b"\x89PNG\r\n\x1a\n junk", "png", "is not a png image"),
        (encoded(8, 8, "JPEG"), "png", "is not a png image"),  # jpeg bytes said to be png
        (encoded(8, 8), "gif", "format is 'gif'"),
        (b"", "png", "data is empty"),
    ],
)
def test_what_is_not_an_image_of_its_format_is_refused_by_name(counter: ImageTokens, data, fmt, says):
    with pytest.raises(ApiError, match=says):
        layout(counter).image(WireImage(0, data, fmt, None, None), 0, "data[0].model_input[0]", [1 << 30])


def test_a_huge_canvas_in_a_small_file_is_refused_from_its_header(counter: ImageTokens):
    """A 6,000² PNG of one colour is a few KB; decoded, 108 MB. Only its header is read."""
    data = encoded(6000, 6000, mode="L")
    assert len(data) < 200_000
    with pytest.raises(ApiError, match=r"a 6000×6000 image; at most \d+ pixels"):
        layout(counter).image(WireImage(0, data, "png", None, None), 0, "x", [1 << 30])
    # past PIL's own bound (twice its MAX_IMAGE_PIXELS) it refuses to open it: said the same way
    bomb = encoded(14000, 14000, mode="1")  # 196 M pixels in 24 KB
    with pytest.raises(ApiError, match=r"the image is over \d+ pixels"):
        layout(counter).image(WireImage(0, bomb, "png", None, None), 0, "x", [1 << 30])
    with pytest.raises(ApiError, match="override_dimensions"):
        layout(counter).image(WireImage(0, encoded(8, 8), "png", None, (1 << 15, 1 << 15)), 0, "x", [1 << 30])


def test_a_requests_images_share_one_pixel_budget(counter: ImageTokens):
    msg = pb.Datum()
    for _ in range(3):
        msg.model_input.add().image.CopyFrom(pb.ImageChunk(data=encoded(4000, 4000, mode="L"), format="png"))
    data = [_datum(msg, i, [1 << 20]) for i in range(6)]  # 6 × 3 × 16 M pixels: over the request's 256 M
    with pytest.raises(ApiError, match="the request's images hold over"):
        layout(counter).data(data)


def test_a_text_only_model_refuses_images_by_its_name():
    with pytest.raises(
        ApiError, match=r"data\[0\]\.model_input\[1\]: image chunks are not supported by Qwen3_5ForCausalLM"
    ):
        layout(None).image(WireImage(1, encoded(8, 8), "png", None, None), 0, "data[0].model_input[1]", [1 << 30])


def test_audio_stays_a_clear_refusal():
    msg = pb.Datum()
    msg.model_input.add().dmel.dmel = b"\x00" * 8
    with pytest.raises(Exception, match=r"data\[0\]\.model_input\[0\]: dmel chunks are not supported"):
        _datum(msg, 0, [1 << 20])


@pytest.mark.parametrize(
    ("chunk", "says"),
    [
        ({"type": "image", "data": "%%%", "format": "png"}, "data is not base64"),
        ({"type": "image", "data": 5, "format": "png"}, "data must be a base64 string"),
        ({"type": "image", "data": "", "format": "png", "expected_tokens": -1}, "expected_tokens must be"),
        ({"type": "image", "data": "", "format": None}, "format must be"),
    ],
)
def test_a_sampling_prompts_json_image_is_checked_field_by_field(counter: ImageTokens, chunk, says):
    with pytest.raises(ApiError, match=says):
        layout(counter).prompt_image(chunk, 0, "prompt.chunks[0]", [1 << 30])


def test_a_sampling_prompts_json_image_is_counted_as_a_datums(counter: ImageTokens):
    chunk = {"type": "image", "data": base64.b64encode(encoded(96, 64)).decode(), "format": "png"}
    image = layout(counter).prompt_image(chunk, 4, "prompt.chunks[1]", [1 << 30])
    assert (image.start, image.tokens) == (4, counter.count(96, 64, "x"))
