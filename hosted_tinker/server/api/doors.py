"""Where each inference door is mounted, said once: the key check, the error shapes and the app's
routers all read it from here.

OpenAI's chat and text completions answer at ``/v1`` (OpenAI's own base path, and vLLM's) and at
``/oai/api/v1`` (the base URL the Tinker service documents for the OpenAI SDK), the same routes
under both. Anthropic's Messages API answers at ``/anthropic/api/v1`` (the service's base URL for
the Anthropic SDKs, which add ``/v1/messages``) and beside the OpenAI routes at ``/v1`` (as vLLM
serves it): ``/v1/messages`` is Anthropic's, everything else under ``/v1`` OpenAI's.
"""

from __future__ import annotations

OPENAI = ("/v1", "/oai/api/v1")
ANTHROPIC = ("/anthropic/api/v1", "/v1")
ANTHROPIC_ROUTES = "/messages"  # what of a shared prefix is Anthropic's


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in prefixes)


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of the Anthropic Messages routes (their errors take Anthropic's shape)."""
    return _under(path, tuple(prefix + ANTHROPIC_ROUTES for prefix in ANTHROPIC)) or _under(path, ANTHROPIC[:1])


def is_openai(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI-compatible routes (their errors take OpenAI's shape)."""
    return _under(path, OPENAI) and not is_anthropic(path)


def is_inference(path: str) -> bool:
    """Whether ``path`` is behind one of the inference doors (each needs a key)."""
    return _under(path, OPENAI + ANTHROPIC)
