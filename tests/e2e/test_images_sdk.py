"""Images in a ModelInput through the front door (#40 item 3): a server on a tiny random Qwen3.5
or Qwen3-VL-MoE vision-language checkpoint, driven by the real tinker SDK with ``ImageChunk``s as the cookbook's
renderers lay them (``<|vision_start|>``, the image, ``<|vision_end|>``): forward_backward trains,
``forward`` equals transformers' own vision-language model, sampling an image prompt scores as
the trainer does; an ``expected_tokens`` that is not the model's count is a 400 naming the chunk
and both counts, before anything runs, and the server serves on."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.server import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ALIAS = "tiny-qwen3.5-vl"


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl_moe"])
def vl(request, tmp_path_factory, tiny_family):
    """A server on a tiny Qwen3.5 (the tower feeds the input embeddings) or Qwen3-VL-MoE (also
    the first decoder layers: deepstack)."""
    from transformers import AutoConfig, AutoImageProcessor

    root = tmp_path_factory.mktemp(request.param)
    model_dir = tiny_family(request.param)
    server = start_server(root / "data", "--model", str(model_dir), alias=ALIAS)
    sc = tinker.ServiceClient(base_url=server.base_url)
    config = AutoConfig.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    yield {"server": server, "sc": sc, "model_dir": model_dir, "config": config, "processor": processor}
    sc.close("success").result()
    server.stop()


def tokens_of(vl, width: int, height: int) -> int:
    """What the model's processor makes of a ``width``×``height`` image, as the cookbook counts it."""
    processor = vl["processor"]
    return processor.get_number_of_image_patches(height, width, {}) // processor.merge_size**2


def image_input(vl, texts: list[list[int]], images: list[tuple[int, int, int]], expected: int | None = 0):
    """``texts[0]``, image 0, ``texts[1]``, …: each image (width, height, seed) wrapped in the
    vision start/end tokens, its ``expected_tokens`` the model's count (``expected`` 0), or
    ``expected`` itself."""
    config = vl["config"]
    chunks: list = []
    for i, text in enumerate(texts):
        chunks.append(types.EncodedTextChunk(tokens=text))
        if i < len(images):
            w, h, seed = images[i]
            count = tokens_of(vl, w, h) if expected == 0 else expected
            chunks += [
                types.EncodedTextChunk(tokens=[config.vision_start_token_id]),
                types.ImageChunk(data=png(w, h, seed), format="png", expected_tokens=count),
                types.EncodedTextChunk(tokens=[config.vision_end_token_id]),
            ]
    return types.ModelInput(chunks=chunks)


def image_datum(model_input: types.ModelInput, targets: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def flat_tokens(vl, model_input: types.ModelInput) -> tuple[list[int], list[tuple[int, int]]]:
    """The sequence as the model sees it (an image: its count of image tokens), and each image's span."""
    tokens: list[int] = []
    spans = []
    for chunk in model_input.chunks:
        if isinstance(chunk, types.ImageChunk):
            spans.append((len(tokens), len(tokens) + chunk.expected_tokens))
            tokens += [vl["config"].image_token_id] * chunk.expected_tokens
        else:
            tokens += chunk.tokens
    return tokens, spans


def sft_datum(vl, model_input: types.ModelInput, answer: list[int]) -> types.Datum:
    """Prompt (text and images) then ``answer``; only the answer is trained on."""
    prompt, _ = flat_tokens(vl, model_input)
    full = prompt + answer
    chunks = [*model_input.chunks, types.EncodedTextChunk(tokens=answer[:-1])]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return image_datum(types.ModelInput(chunks=chunks), full[1:], weights)


def test_training_on_images_learns_and_forward_is_the_vision_language_models_own(vl):
    from transformers import AutoModelForImageTextToText

    sc = vl["sc"]
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    # two images side by side, one between texts, and a datum of text alone, in one batch
    batch = [
        sft_datum(vl, image_input(vl, [[5, 6], [], [7]], [(96, 64, 0), (64, 64, 1)]), [40, 41, 42]),
        sft_datum(vl, image_input(vl, [[8, 9, 10], [11]], [(40, 72, 2)]), [50, 51]),
        image_datum(types.ModelInput.from_ints([20, 21, 22, 23]), [21, 22, 23, 24], [1.0] * 4),
    ]
    # a fresh adapter (B = 0) is the base model: forward equals transformers' model on each alone
    served = tc.forward(batch, "cross_entropy").result().loss_fn_outputs
    whole = AutoModelForImageTextToText.from_pretrained(vl["model_dir"], dtype=torch.float32).eval()
    from PIL import Image

    for d, out in zip(batch, served, strict=True):
        tokens, spans = flat_tokens(vl, d.model_input)
        images = [Image.open(io.BytesIO(c.data)) for c in d.model_input.chunks if isinstance(c, types.ImageChunk)]
        kwargs = {}
        if images:
            pixels = vl["processor"](images=images, return_tensors="pt")
            types_ = torch.zeros(1, len(tokens), dtype=torch.int32)
            for s, e in spans:
                types_[0, s:e] = 1
            kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            kwargs["mm_token_type_ids"] = types_
        with torch.no_grad():
            logits = whole(input_ids=torch.tensor([tokens]), **kwargs).logits[0]
        whole.model.rope_deltas = None
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
        theirs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].numpy()
        np.testing.assert_allclose(out["logprobs"].to_numpy(), theirs, rtol=0, atol=2e-5)
    losses = []
    for _ in range(4):
        losses.append(tc.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert losses[-1] < losses[0]
    vl["tc"] = tc


def test_sampling_an_image_prompt_scores_as_the_trainer(vl):
    tc = vl.get("tc") or vl["sc"].create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = image_input(vl, [[5, 6], [7]], [(96, 64, 0)])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    result = sampler.sample(prompt, 2, params, include_prompt_logprobs=True).result()
    tokens, _ = flat_tokens(vl, prompt)
    for seq in result.sequences:
        chunks = [*prompt.chunks, types.EncodedTextChunk(tokens=seq.tokens[:-1])]
        full = tokens + seq.tokens
        d = image_datum(types.ModelInput(chunks=chunks), full[1:], [0.0] * (len(full) - 1))
        trainer = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, trainer[len(tokens) - 1 :], rtol=0, atol=1e-4)
        np.testing.assert_allclose(result.prompt_logprobs[1:], trainer[: len(tokens) - 1], rtol=0, atol=1e-4)


def test_expected_tokens_that_are_not_the_models_count_are_a_400_naming_both(vl):
    tc = vl["sc"].create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    actual = tokens_of(vl, 96, 64)
    wrong = image_input(vl, [[5, 6], [7]], [(96, 64, 0)], expected=actual + 3)
    tokens, _ = flat_tokens(vl, wrong)
    with pytest.raises(tinker.BadRequestError) as refused:
        tc.forward_backward([image_datum(wrong, tokens, [1.0] * len(tokens))], "cross_entropy").result()
    message = str(refused.value)
    assert "data[0].model_input[2]" in message and str(actual) in message and str(actual + 3) in message
    sampler = vl["sc"].create_sampling_client(base_model=ALIAS).result()
    with pytest.raises(tinker.BadRequestError) as refused:
        sampler.sample(wrong, 1, types.SamplingParams(max_tokens=2)).result()
    assert "prompt.chunks[2]" in str(refused.value) and str(actual + 3) in str(refused.value)
    # bytes that are no png: named, and the server trains on
    broken = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[5]),
            types.ImageChunk(data=b"\x89PNG junk", format="png", expected_tokens=6),
        ]
    )
    with pytest.raises(tinker.BadRequestError, match=r"model_input\[1\]\.data is not a png image"):
        tc.forward_backward([image_datum(broken, [1] * 7, [1.0] * 7)], "cross_entropy").result()
    ok = image_input(vl, [[5, 6], [7]], [(96, 64, 0)])
    tokens, _ = flat_tokens(vl, ok)
    tc.forward_backward([image_datum(ok, tokens, [1.0] * len(tokens))], "cross_entropy").result()


def test_the_server_says_it_takes_images(vl):
    health = httpx.get(f"{vl['server'].base_url}/healthz", timeout=10).raise_for_status().json()
    caps = health["capabilities"]
    assert caps["images"] is True and caps["image_token_id"] == vl["config"].image_token_id
