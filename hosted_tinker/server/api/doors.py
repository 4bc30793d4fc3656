"""Where each inference door is mounted, said once: the key check, the error shapes and the app's
routers all read it from here.

OpenAI's chat and text completions answer at ``/v1`` (OpenAI's own base path, and vLLM's) and at
``/oai/api/v1`` (the base URL the Tinker service documents for the OpenAI SDK), the same routes
under both.
"""

from __future__ import annotations

OPENAI = ("/v1", "/oai/api/v1")


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in prefixes)


def is_openai(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI-compatible routes (their errors take OpenAI's shape)."""
    return _under(path, OPENAI)
