"""What the rank code passes around of transformers' models, read by attribute name.

A causal LM of the served family is an instance of that family's own classes, which share no
base class that declares what this code reads (``config``, ``get_output_embeddings``,
``base_model_prefix``, ``set_attn_implementation``); torch types whatever is read by name off a
module as ``Tensor | Module``. So such a model is typed as what it is read as: anything.
"""

from __future__ import annotations

from typing import Any, TypeAlias

CausalLM: TypeAlias = Any  # a transformers model of the served family, with its LM head
