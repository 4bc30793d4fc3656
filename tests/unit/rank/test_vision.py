"""Images in the sequences a rank trains on and samples from (``rank.vision``), on tiny
Qwen3.5 and Qwen3-VL (deepstack; MoE and dense) checkpoints: the trainer's log-probs equal transformers' own
vision-language model on each sequence alone, packed or not; the M-RoPE positions are the
model's own; only LoRA trains; the embedded sampler's log-probs equal the trainer's forward.
Through the SDK: ``tests/e2e/test_images_sdk.py``; the server's count and refusals:
``tests/unit/server/test_images.py``."""

from __future__ import annotations

import pytest
import torch

from hosted_tinker.core.sampling import SampleSpec
from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.model import HfLoraModel
from hosted_tinker.rank.serve import Rank, local_rank
from tests.support.images import image_datum as support_datum
from tests.support.images import png

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl_moe", "qwen3_vl"])
def model_dir(request, tmp_path_factory):
    family = request.param
    return build_tiny_model(tmp_path_factory.mktemp("models") / family, family=family, hidden_size=64)


@pytest.fixture(scope="module")
def rank(model_dir) -> Rank:
    return local_rank(str(model_dir))


@pytest.fixture(scope="module")
def whole(model_dir):
    """transformers' own vision-language model of the checkpoint: the reference."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def image_datum(model: HfLoraModel, texts: list[list[int]], images: list[bytes]) -> DatumInput:
    return support_datum(model.vision.model.config, model.vision.processor, texts, images)


def reference(whole, d: DatumInput) -> torch.Tensor:
    """transformers' vision-language model on the datum alone: its processor's pixels, its own
    placeholder mask and rope index, log-probs of the targets."""
    from hosted_tinker.core.images import pixels

    proc = whole_processor(whole)
    ids = d.tokens[None]
    if d.images:
        batch = proc(images=[pixels(im, "ref") for im in d.images], return_tensors="pt")
        types = torch.zeros_like(ids, dtype=torch.int32)
        for im in d.images:
            types[0, im.start : im.end] = 1
        out = whole(
            input_ids=ids,
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            mm_token_type_ids=types,
        )
    else:
        out = whole(input_ids=ids)
    whole.model.rope_deltas = None  # the model keeps the last call's deltas for generation
    logp = torch.log_softmax(out.logits[0].double(), -1)
    return logp.gather(-1, d.target_tokens[:, None])[:, 0]


def whole_processor(whole):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(whole.config.name_or_path)


def test_the_checkpoint_loads_as_its_language_model_over_the_whole_models_modules(rank: Rank, whole):
    model = rank.trainer.model
    assert model.vision is not None and rank.capabilities.images
    assert rank.capabilities.image_token_id == whole.config.image_token_id
    # Tinker's adapter names: model.layers..., lm_head (Qwen3-VL has no such class: one is made)
    assert type(model.base).__name__ == type(whole).__name__.replace("ForConditionalGeneration", "ForCausalLM")
    assert {name for name, _ in model.base.named_children()} == {"model", "lm_head"}
    # the language model's weights are the checkpoint's (loaded once, shared with the tower's model)
    theirs = dict(whole.model.language_model.named_parameters())
    for name, p in model.base.model.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=0)
    tied = model.base.lm_head.weight is model.base.model.embed_tokens.weight
    assert tied == whole.config.tie_word_embeddings  # as the checkpoint says
    assert not any(p.requires_grad for p in model.vision.model.visual.parameters())
    # what is set on the causal LM reaches the language model's layers (one config object)
    assert model.base.config is model.base.model.config
    assert model.base.model.config._attn_implementation == model.attention_impl


def test_log_probs_with_images_equal_the_vision_language_models_own(rank: Rank, whole):
    """Two datums with images (two side by side in one, split by text in the other) and one of
    text alone, packed in one pass: each equals transformers' model on it alone."""
    model = rank.trainer.model
    handle = model.add_adapter(LoraSpec(rank=4, seed=0))
    try:
        data = [
            image_datum(model, [[5, 6, 7], [8, 9], [10, 11, 12]], [png(96, 64, 0), png(64, 64, 1)]),
            image_datum(model, [[20, 21], [22, 23, 24, 25]], [png(40, 72, 2)]),
            image_datum(model, [[30, 31, 32, 33, 34, 35]], []),
        ]
        with torch.no_grad():
            ours = model.logprobs([handle] * len(data), data)
        for d, got in zip(data, ours, strict=True):
            torch.testing.assert_close(got.double(), reference(whole, d), rtol=0, atol=2e-5)
        # alone, each is what it is in the pack
        with torch.no_grad():
            alone = model.logprobs([handle], [data[0]])[0]
        torch.testing.assert_close(alone, ours[0], rtol=0, atol=1e-5)
    finally:
        model.remove_adapter(handle)


def test_positions_of_images_are_the_models_rope_index(rank: Rank, whole):
    model = rank.trainer.model
    d = image_datum(model, [[5, 6], [7, 8, 9], [10]], [png(96, 64, 0), png(48, 80, 1)])
    proc = whole_processor(whole)
    from hosted_tinker.core.images import pixels

    grids = proc(images=[pixels(im, "ref") for im in d.images], return_tensors="pt")["image_grid_thw"]
    types = torch.zeros(1, d.num_tokens, dtype=torch.int32)
    for im in d.images:
        types[0, im.start : im.end] = 1
    theirs, _ = whole.model.get_rope_index(d.tokens[None], types, image_grid_thw=grids)
    ours = model.vision.positions(d.num_tokens, list(d.images), grids)
    torch.testing.assert_close(ours, theirs[:, 0], rtol=0, atol=0)


def test_only_lora_trains_with_images(rank: Rank):
    model = rank.trainer.model
    handle = model.add_adapter(LoraSpec(rank=4, seed=0))
    try:
        for p in handle.params[1::2]:  # B starts at zero: give the A's a gradient to carry
            torch.nn.init.normal_(p, std=0.1)
        d = image_datum(model, [[5, 6, 7], [8, 9]], [png(96, 64, 0)])
        loss = -model.logprobs([handle], [d])[0].sum()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in handle.params)
        frozen = [*model.base.parameters(), *model.vision.model.visual.parameters()]
        assert all(p.grad is None for p in frozen)
    finally:
        model.remove_adapter(handle)


def test_the_sampler_scores_an_image_prompt_as_the_trainer(rank: Rank):
    """The embedded sampler on a prompt with an image, beside a text-only one that joins the same
    run: its prompt and sampled log-probs equal the trainer's forward of prompt + samples."""
    model, sampler = rank.trainer.model, rank.sampler
    d = image_datum(model, [[5, 6, 7], [8, 9]], [png(96, 64, 0)])
    prompts = [d.tokens.tolist(), [40, 41, 42, 43]]
    specs = [
        SampleSpec(prompt=p, max_tokens=6, num_samples=2, seed=3, prompt_logprobs=True, images=images)
        for p, images in ((prompts[0], d.images), (prompts[1], ()))
    ]
    outputs = sampler.generate(None, specs)
    handle = model.add_adapter(LoraSpec(rank=4, seed=0))  # B = 0: the base model's log-probs
    try:
        for spec, out in zip(specs, outputs, strict=True):
            for seq in out.sequences:
                full = torch.tensor(spec.prompt + seq.tokens)
                datum = DatumInput(full[:-1], full[1:], {}, spec.images)
                with torch.no_grad():
                    trainer = model.logprobs([handle], [datum])[0]
                n = len(spec.prompt)
                torch.testing.assert_close(torch.tensor(seq.logprobs), trainer[n - 1 :], rtol=0, atol=1e-4)
                torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), trainer[: n - 1], rtol=0, atol=1e-4)
    finally:
        model.remove_adapter(handle)


def test_a_checkpoint_without_its_image_processor_trains_as_a_language_model(rank: Rank, model_dir, tmp_path):
    """No preprocessor_config.json: no image can be counted, so none is offered; the language
    model is the same one."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    text_only = local_rank(str(bare))
    assert not text_only.capabilities.images and text_only.trainer.model.vision is None
    d = image_datum(rank.trainer.model, [list(range(5, 30))], [])
    got = []
    for model in (rank.trainer.model, text_only.trainer.model):
        handle = model.add_adapter(LoraSpec(rank=4, seed=0))
        with torch.no_grad():
            got.append(model.logprobs([handle], [d])[0])
        model.remove_adapter(handle)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-6)


def test_two_adapters_in_one_pass_and_recomputed_layers_see_the_same_images(rank: Rank):
    """A joint pass (two tenants' adapters, their datums with images packed together) equals each
    tenant's pass alone; recomputing the decoder layers in the backward pass changes no gradient."""
    model = rank.trainer.model
    a, b = (model.add_adapter(LoraSpec(rank=4, seed=s)) for s in (1, 2))
    try:
        for handle in (a, b):
            for p in handle.params[1::2]:
                torch.nn.init.normal_(p, std=0.1)
        data = [
            image_datum(model, [[5, 6, 7], [8, 9]], [png(96, 64, 0)]),
            image_datum(model, [[10], [11, 12]], [png(64, 48, 1)]),
        ]
        joint = model.logprobs([a, b], data)
        grads = torch.autograd.grad(sum(x.sum() for x in joint), [*a.params, *b.params])
        alone = [model.logprobs([h], [d])[0] for h, d in zip((a, b), data, strict=True)]
        for got, want in zip(joint, alone, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        recomputed = model.logprobs([a, b], data, recompute=len(model.layers))
        again = torch.autograd.grad(sum(x.sum() for x in recomputed), [*a.params, *b.params])
        for g, h in zip(grads, again, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)
    finally:
        model.remove_adapter(a)
        model.remove_adapter(b)
