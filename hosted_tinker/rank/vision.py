"""Images in the sequences a rank trains on and samples from (``core.images``): a
vision-language checkpoint's frozen vision tower, its image processor, and the 3-D rotary
positions (M-RoPE) its language model takes for them.

The language model is what trains: it is loaded as the checkpoint's causal LM (the names
Tinker's adapters use, ``model.layers...``), over the very modules of the vision-language model,
whose tower turns each image into the embeddings of its placeholder positions. The tower takes
no LoRA and no gradient (Tinker's documentation does not say whether its service trains it;
its adapters' layout, as the cookbook reads them, has no vision modules).

Families (``VISION_FAMILIES``): Qwen3.5 / 3.6, whose tower feeds the input embeddings; Qwen3-VL
(dense and MoE), whose tower also feeds the first decoder layers' hidden states at the image
positions ("deepstack"), passed to its language model as transformers' own forward takes them.
Qwen3-VL has no causal-LM class in transformers: ``causal_lm`` makes one over its parts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from hosted_tinker.core.images import ImageInput, pixels
from hosted_tinker.core.pretrained import auto_image_processor
from hosted_tinker.rank.hf import CausalLM

VISION_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")


def load(
    model_path: str, config, dtype: torch.dtype, **options
) -> tuple[nn.Module, nn.Module, VisionTower | None] | None:
    """A vision-language checkpoint of a family above: its causal LM over the whole model's
    modules, the whole model, and its vision tower if images can be fed (the checkpoint has its
    image processor's config, without which no image can be counted). None for any other
    checkpoint, and for one that trains as its causal LM alone (no image processor, and a
    causal-LM class transformers loads it as)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if config.model_type not in VISION_FAMILIES or getattr(config, "vision_config", None) is None:
        return None
    images = (Path(model_path) / "preprocessor_config.json").is_file()
    if not images and type(config.get_text_config()) in AutoModelForCausalLM._model_mapping:
        return None
    whole = AutoModelForImageTextToText.from_pretrained(model_path, config=config, dtype=dtype, **options)
    return causal_lm(whole), whole, VisionTower(whole, model_path) if images else None


def causal_lm(whole: CausalLM) -> CausalLM:
    """The language model of ``whole`` (a vision-language model) as a causal LM over its very
    modules, named as Tinker's adapters name them (``model.layers...``, ``lm_head``): the
    ``...ForCausalLM`` class transformers maps its text config to, or one made here."""
    from transformers import AutoModelForCausalLM

    language = whole.model.language_model
    mapped = AutoModelForCausalLM._model_mapping.get(type(language.config), None)
    if mapped is not None:
        with torch.device("meta"):  # a shell: every module of it is replaced by the loaded ones
            lm = mapped(language.config)  # type: ignore[operator]  # .get answers the class (typed as a pair)
        lm.model, lm.lm_head = language, whole.lm_head
    else:
        lm = _text_causal_lm(type(whole))(language.config, language, whole.lm_head)
    # the language model's own config object: attention and experts implementations set on the
    # causal LM reach its modules only through it (transformers skips a sub-model of the same config class)
    lm.config = language.config
    lm.config.name_or_path = whole.config.name_or_path
    lm.generation_config = whole.generation_config
    loaded = {id(t) for t in (*whole.parameters(), *whole.buffers())}
    if any(id(t) not in loaded for t in (*lm.parameters(), *lm.buffers())):
        raise RuntimeError(f"{type(lm).__name__} over {type(whole).__name__}: a module of its own was left")
    return lm


def _text_causal_lm(whole_class: type) -> type:
    """A causal-LM class for a vision-language class that has none (Qwen3-VL): the family's own
    pretrained base (its attention and experts switches), a decoder as ``model`` and a head."""
    from transformers import PreTrainedModel

    base = next(c for c in whole_class.__mro__[1:] if issubclass(c, PreTrainedModel) and c is not PreTrainedModel)

    def __init__(self, config, model: nn.Module, lm_head: nn.Module) -> None:
        base.__init__(self, config)
        self.model, self.lm_head = model, lm_head

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: Tensor | None = None, **kwargs):
        """As a causal LM's forward: the decoder's output, with the logits of every position."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, **kwargs)
        # past_key_values: transformers 4's name (5 takes it as the deprecated alias of ``cache``)
        return CausalLMOutputWithPast(
            logits=self.lm_head(out.last_hidden_state),
            past_key_values=out.cache,  # type: ignore[call-arg]
        )

    members = {
        "__init__": __init__,
        "forward": forward,
        "get_output_embeddings": get_output_embeddings,
        "get_input_embeddings": get_input_embeddings,
        "base_model_prefix": "model",
        # the family's module: transformers reads a model's source there to decide whether its
        # experts implementation may be switched (``rank.experts`` switches it)
        "__module__": base.__module__,
    }
    return type(whole_class.__name__.replace("ForConditionalGeneration", "ForCausalLM"), (base,), members)


class VisionTower:
    """The image side of a vision-language model: pixels to embeddings, and M-RoPE positions.
    Frozen; called under ``no_grad``."""

    def __init__(self, whole: CausalLM, model_path: str) -> None:
        self.model = whole.model  # get_image_features, get_vision_position_ids
        self.model.visual.requires_grad_(False)
        self.processor = auto_image_processor(model_path)
        self.image_token_id = int(whole.config.image_token_id)
        self.merge = int(self.model.visual.spatial_merge_size)

    @torch.no_grad()
    def features(self, images: list[ImageInput], where: list[str]) -> tuple[list[list[Tensor]], Tensor]:
        """Each image's embeddings: ``(tokens, H)`` for the input, then one per deepstack layer
        (Qwen3-VL; none for Qwen3.5); and their patch grids ``(len(images), 3)``; in one pass of
        the tower."""
        decoded = [pixels(image, w) for image, w in zip(images, where, strict=True)]
        batch = self.processor(images=decoded, return_tensors="pt")
        grids = batch["image_grid_thw"]
        for image, grid, w in zip(images, grids, where, strict=True):
            made = int(grid.prod()) // self.merge**2
            if made != image.tokens:  # the server counted with the same processor: not the caller's doing
                raise RuntimeError(f"{w}: the processor made {made} tokens of an image counted as {image.tokens}")
        device = next(self.model.visual.parameters()).device
        out = self.model.get_image_features(batch["pixel_values"].to(device), grids.to(device))
        deepstack = getattr(out, "deepstack_features", None) or []
        return [[first, *(level[i] for level in deepstack)] for i, first in enumerate(out.pooler_output)], grids

    def positions(self, n: int, images: list[ImageInput], grids: Tensor) -> Tensor:
        """A sequence's M-RoPE positions ``(3, n)``: text runs count on in all three rows; an
        image takes its grid's (time, row, column) positions from where it starts, and the text
        after it goes on from past its largest. As the model's own ``get_rope_index``, but per
        image, so that two images side by side stay two."""
        parts: list[Tensor] = []
        at, next_pos = 0, 0
        for image, grid in zip(images, grids, strict=True):
            if image.start > at:
                parts.append(torch.arange(next_pos, next_pos + image.start - at).expand(3, -1))
                next_pos += image.start - at
            parts.append(self.model.get_vision_position_ids(next_pos, grid, 1, self.merge).cpu())
            next_pos += max(int(grid[1]), int(grid[2])) // self.merge
            at = image.end
        if n > at:
            parts.append(torch.arange(next_pos, next_pos + n - at).expand(3, -1))
        return torch.cat(parts, dim=1)

    def embed(
        self,
        embed_tokens: nn.Module,
        ids: Tensor,
        text_positions: Tensor,
        placed: list[tuple[int, int, int, tuple[ImageInput, ...]]],
        where: list[str],
    ) -> dict[str, Tensor | list[Tensor]]:
        """The language model's inputs for rows ``ids`` ``(B, L)``: ``inputs_embeds`` ``(B, L, H)``
        with each image's in its positions; ``position_ids`` ``(4, B, L)``: ``text_positions`` (each
        sequence's own count, for the attention's masks) over the three M-RoPE rows; and, for a
        tower with deepstack layers, the image positions and what each of those layers adds there
        (``visual_pos_masks``, ``deepstack_visual_embeds``, as Qwen3-VL's language model takes them).

        ``placed``: per sequence with images, ``(row, offset, n, images)``: it holds positions
        ``offset .. offset + n`` of row ``row``; sequences that share one ``images`` tuple (a
        request's samples) share its pass through the tower. ``where`` names each's images."""
        named: dict[int, tuple[str, tuple[ImageInput, ...]]] = {}
        for (_, _, _, images), w in zip(placed, where, strict=True):
            named.setdefault(id(images), (w, images))
        flat = [image for _, images in named.values() for image in images]
        names = [f"{w}.images[{j}]" for w, images in named.values() for j in range(len(images))]
        features, grids = self.features(flat, names)
        first, k = {}, 0
        for key, (_, images) in named.items():
            first[key] = k
            k += len(images)
        embeds = embed_tokens(ids)
        rope = text_positions[None].expand(3, -1, -1).clone()
        rows, cols, values = [], [], []
        # row-major: the order in which the deepstack layers' additions meet their positions
        for row, offset, n, images in sorted(placed, key=lambda p: (p[0], p[1])):
            k = first[id(images)]
            rope[:, row, offset : offset + n] = self.positions(n, list(images), grids[k : k + len(images)])
            for j, image in enumerate(images):
                cols.append(torch.arange(offset + image.start, offset + image.end))
                rows.append(torch.full((image.tokens,), row))
                values.append(features[k + j])
        index = (torch.cat(rows).to(embeds.device), torch.cat(cols).to(embeds.device))
        levels = [torch.cat(level).to(embeds.dtype) for level in zip(*values, strict=True)]
        inputs = {
            "inputs_embeds": embeds.index_put(index, levels[0]),
            "position_ids": torch.cat([text_positions[None], rope]).to(embeds.device),
        }
        if len(levels) > 1:
            mask = torch.zeros(ids.shape, dtype=torch.bool, device=embeds.device)
            mask[index] = True
            inputs |= {"visual_pos_masks": mask, "deepstack_visual_embeds": levels[1:]}
        return inputs
