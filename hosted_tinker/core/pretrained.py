"""A checkpoint's config, tokenizer and image processor, as transformers loads them, without
running code of the checkpoint's own: a folder whose config names its own classes (``auto_map``,
for a model transformers does not have: Kimi-K2's ``kimi_k2``, say) is refused in one line that
says so, rather than transformers' prompt to pass ``trust_remote_code``, an option this server
does not have."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hosted_tinker.core.errors import UserError


@contextlib.contextmanager
def _no_remote_code(model_path: str, what: str) -> Iterator[None]:
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise UserError(
            f"{model_path}: its {what} is code of the checkpoint's own (auto_map), which this server does not run; "
            "it serves models whose classes transformers has"
        ) from None


def auto_config(model_path: str) -> Any:
    from transformers import AutoConfig

    with _no_remote_code(model_path, "config"):
        return AutoConfig.from_pretrained(model_path, trust_remote_code=False)


def auto_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    with _no_remote_code(model_path, "tokenizer"):
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


def auto_image_processor(model_path: str) -> Any:
    from transformers import AutoImageProcessor

    with _no_remote_code(model_path, "image processor"):
        return AutoImageProcessor.from_pretrained(model_path, trust_remote_code=False)
