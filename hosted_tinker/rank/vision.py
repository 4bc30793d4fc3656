"""Images in the sequences a rank trains on and samples from (``core.images``): a
vision-language checkpoint's frozen vision tower, its image processor, and the 3-D rotary
positions (M-RoPE) its language model takes for them.

The language model is what trains: it is loaded as the checkpoint's causal LM (the names
Tinker's adapters use, ``model.layers...``), over the very modules of the vision-language model,
whose tower turns each image into the embeddings of its placeholder positions. The tower takes
no LoRA and no gradient (Tinker's documentation does not say whether its service trains it;
its adapters' layout, as the cookbook reads them, has no vision modules).

Families: Qwen3.5 / 3.6 (``VISION_FAMILIES``), whose tower feeds the input embeddings only.
Qwen3-VL's also feeds early decoder layers ("deepstack"), which this path does not: it is not
offered images (``Capabilities.images``) rather than given a different model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from hosted_tinker.core.images import ImageInput, pixels

VISION_FAMILIES = ("qwen3_5", "qwen3_5_moe")


def takes_images(config, model_path: str) -> bool:
    """Whether the checkpoint at ``model_path`` is a vision-language model whose images this
    server feeds: of a family above, with its vision tower's config and its image processor's
    (without which no image can be counted: it trains on text, as a language model)."""
    return (
        config.model_type in VISION_FAMILIES
        and getattr(config, "vision_config", None) is not None
        and (Path(model_path) / "preprocessor_config.json").is_file()
    )


def load_with_tower(model_path: str, config, dtype: torch.dtype, **options) -> tuple[nn.Module, nn.Module]:
    """The checkpoint's causal LM (its text config, the ``...ForCausalLM`` class transformers maps
    it to) built over the modules of the whole vision-language model, and that model: one load,
    the language model's weights held once."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    whole = AutoModelForImageTextToText.from_pretrained(model_path, config=config, dtype=dtype, **options)
    with torch.device("meta"):  # a shell: every module of it is replaced by the loaded ones
        lm = AutoModelForCausalLM.from_config(config.get_text_config(), dtype=dtype)
    lm.model = whole.model.language_model
    lm.lm_head = whole.lm_head
    # the language model's own config object: attention and experts implementations set on the
    # causal LM reach its modules only through it (transformers skips a sub-model of the same config class)
    lm.config = lm.model.config
    lm.config.name_or_path = whole.config.name_or_path
    lm.generation_config = whole.generation_config
    if any(t.is_meta for t in (*lm.parameters(), *lm.buffers())):
        raise RuntimeError(f"{type(lm).__name__} over {type(whole).__name__}: a module was left unloaded")
    return lm, whole


class VisionTower:
    """The image side of a vision-language model: pixels to embeddings, and M-RoPE positions.
    Frozen; called under ``no_grad``."""

    def __init__(self, whole: nn.Module, model_path: str) -> None:
        from transformers import AutoImageProcessor

        self.model = whole.model  # get_image_features, get_vision_position_ids
        self.model.visual.requires_grad_(False)
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = int(whole.config.image_token_id)
        self.merge = int(self.model.visual.spatial_merge_size)

    @torch.no_grad()
    def features(self, images: list[ImageInput], where: list[str]) -> tuple[list[Tensor], Tensor]:
        """Each image's embeddings ``(tokens, H)``, and their patch grids ``(len(images), 3)``,
        in one pass of the tower."""
        decoded = [pixels(image, w) for image, w in zip(images, where, strict=True)]
        batch = self.processor(images=decoded, return_tensors="pt")
        grids = batch["image_grid_thw"]
        for image, grid, w in zip(images, grids, where, strict=True):
            made = int(grid.prod()) // self.merge**2
            if made != image.tokens:  # the server counted with the same processor: not the caller's doing
                raise RuntimeError(f"{w}: the processor made {made} tokens of an image counted as {image.tokens}")
        device = next(self.model.visual.parameters()).device
        out = self.model.get_image_features(batch["pixel_values"].to(device), grids.to(device))
        return list(out.pooler_output), grids

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
    ) -> tuple[Tensor, Tensor]:
        """Inputs for a language model over rows ``ids`` ``(B, L)``: their embeddings ``(B, L, H)``
        with each image's in its positions, and positions ``(4, B, L)``: ``text_positions`` (each
        sequence's own count, for the attention's masks) over the three M-RoPE rows.

        ``placed``: per sequence with images, ``(row, offset, n, images)``: it holds positions
        ``offset .. offset + n`` of row ``row``; sequences that share one ``images`` tuple (a
        request's samples) share its pass through the tower. ``where`` names each's images."""
        named: dict[int, tuple[str, tuple[ImageInput, ...]]] = {}
        for (_, _, _, images), w in zip(placed, where, strict=True):
            named.setdefault(id(images), (w, images))
        distinct = [images for _, images in named.values()]
        flat = [image for images in distinct for image in images]
        names = [f"{w}.images[{j}]" for w, images in named.values() for j in range(len(images))]
        features, grids = self.features(flat, names)
        first, k = {}, 0
        for images in distinct:
            first[id(images)] = k
            k += len(images)
        embeds = embed_tokens(ids)
        rope = text_positions[None].expand(3, -1, -1).clone()
        rows, cols, values = [], [], []
        for row, offset, n, images in placed:
            k = first[id(images)]
            rope[:, row, offset : offset + n] = self.positions(n, list(images), grids[k : k + len(images)])
            for j, image in enumerate(images):
                cols.append(torch.arange(offset + image.start, offset + image.end))
                rows.append(torch.full((image.tokens,), row))
                values.append(features[k + j])
        if values:
            index = (torch.cat(rows).to(embeds.device), torch.cat(cols).to(embeds.device))
            embeds = embeds.index_put(index, torch.cat(values).to(embeds.dtype))
        positions = torch.cat([text_positions[None], rope]).to(embeds.device)
        return embeds, positions
