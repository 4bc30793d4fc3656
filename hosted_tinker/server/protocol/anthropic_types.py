"""Wire types of the Anthropic Messages API (``/anthropic/api/v1/messages``, ``/v1/messages``):
requests, whose unknown fields are refused by name (``protocol.strict``), and responses, as the
Anthropic SDKs read them (``responses.Response``: every key sent is declared, no other)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from hosted_tinker.server.protocol.responses import ERROR_STATUSES, Response
from hosted_tinker.server.protocol.strict import ListOf, StrictRequest

# A content block is checked by the service (``serving.anthropic``), which names the block that
# it cannot take ("messages[2].content[1]: ...") rather than every union member pydantic tried.
Content = str | ListOf[dict[str, Any]]


class MessageParam(StrictRequest):
    role: Literal["user", "assistant"]
    content: Content


class _Prompt(StrictRequest):
    model: str
    messages: ListOf[MessageParam] = Field(min_length=1)
    system: Content | None = None
    # Checked by the service, which names what it cannot take (a server tool, a forced choice).
    tools: ListOf[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: ListOf[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: a label for the caller's own use; not used


class CountTokensRequest(_Prompt):
    pass


# ---- responses ------------------------------------------------------------------------------


class TextContent(Response):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(Response):
    input_tokens: int
    output_tokens: int


class Message(Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[TextContent | ToolUseContent, Field(discriminator="type")]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(Response):
    input_tokens: int


class AnthropicErrorBody(Response):
    type: str
    message: str


class AnthropicErrorResponse(Response):
    """Anthropic's error body, which its SDKs turn into typed exceptions."""

    type: Literal["error"] = "error"
    error: AnthropicErrorBody


ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": AnthropicErrorResponse} for s in ERROR_STATUSES}
# Anthropic's error types by status (its API's "Errors" page); any other 5xx is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
