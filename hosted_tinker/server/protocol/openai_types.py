"""Request types of the OpenAI-compatible API (``/v1``). Unknown fields are refused by name
(``protocol.strict``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hosted_tinker.server.protocol.strict import ListOf, StrictRequest


class StreamOptions(StrictRequest):
    include_usage: bool = False


class _SamplingFields(StrictRequest):
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | ListOf[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label; accepted, not used
    # Penalties change the sampling distribution; we implement none, so only 0 is accepted.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionRequest(_SamplingFields):
    prompt: str | ListOf[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top-k alternatives per token
    echo: bool = False


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | ListOf[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: ListOf[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
