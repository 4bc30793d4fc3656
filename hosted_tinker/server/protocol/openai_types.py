"""Wire types of the OpenAI-compatible API (``/v1``): requests, whose unknown fields are refused
by name (``protocol.strict``), and responses (``responses.Response``: every key sent is declared,
no other)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hosted_tinker.server.protocol.responses import Response
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
    tool_calls: ListOf[dict[str, Any]] | None = None  # an assistant's (checked by serving.openai_chat)
    tool_call_id: str | None = None  # a tool result's: which call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: ListOf[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Where the chat template takes tools (serving.openai_chat says what is refused, and why).
    tools: ListOf[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# ---- responses (what the OpenAI SDK's types hold) -----------------------------------------


class OpenAIModel(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(Response):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(Response):
    index: int
    finish_reason: Literal["stop", "length", "content_filter"] | None = None
    text: str
    logprobs: CompletionLogprobs | None = None


class Completion(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Response):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(Response):
    name: str
    arguments: str  # JSON


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # left out when the model called nothing, as OpenAI's answers leave it
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda calls: calls is None)


class ChatChoice(Response):
    index: int
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"] | None = None
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
