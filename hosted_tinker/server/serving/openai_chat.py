"""OpenAI chat messages as the model's chat template takes them, tools included, and tool calls
as OpenAI's chat completions return them. Pure functions over the request types."""

from __future__ import annotations

import json
import secrets
from typing import Any

from hosted_tinker.core.errors import bad_request
from hosted_tinker.server.protocol.openai_types import ChatCompletionRequest
from hosted_tinker.server.serving.tool_calls import Schemas, ToolCall, ToolForm, schemas


def offered_tools(req: ChatCompletionRequest) -> Schemas | None:
    """The parameter schemas of the tools the model is told of (calls are read out of its answer
    as they say), None when it is told of none."""
    return schemas(req.tools) if req.tools and req.tool_choice != "none" else None


def _content(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if not isinstance(content, list):
        return content or ""
    if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
        raise bad_request(f"{where}: only text parts, each with a string text, are supported")
    return "".join(part["text"] for part in content)


def _call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's tool call, its arguments as the object the template writes."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"{where}: a tool call is of type function, with a function")
    if not isinstance(function.get("name"), str):
        raise bad_request(f"{where}.function.name: a string")
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments: a JSON object, as a string")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def chat_messages(req: ChatCompletionRequest, form: ToolForm | None) -> tuple[list[dict[str, Any]], list | None]:
    """The template's messages and tools of a chat completion request; ``form``: how the template
    writes tool calls, None if it takes no tools (tools and tool turns are then a 400)."""
    if req.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice: only auto and none (a forced call needs constrained decoding, not served here)")
    if req.parallel_tool_calls is False:
        raise bad_request("parallel_tool_calls: false is not served (the model may write several calls)")
    tools = None
    if req.tools:
        if form is None:
            raise bad_request(
                "tools: this model's chat template takes no tools (or writes calls in a form not read here)"
            )
        for i, tool in enumerate(req.tools):
            function = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("description", ""), str)
                or not isinstance(function.get("parameters", {}), dict)
            ):
                raise bad_request(
                    f"tools[{i}]: a tool is {{'type': 'function', 'function': {{'name': str, 'description': str, "
                    "'parameters': a JSON schema object}}}}"
                )
        tools = list(req.tools) if offered_tools(req) is not None else None
    messages = []
    for i, m in enumerate(req.messages):
        message: dict[str, Any] = {"role": m.role, "content": _content(m.content, f"messages[{i}].content")}
        if m.tool_calls or m.role == "tool":
            if form is None:
                raise bad_request(f"messages[{i}]: tool calls and results need a model whose chat template takes tools")
            message["tool_calls"] = [
                _call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls or [])
            ]
        messages.append(message)
    return messages, tools


def tool_call_entries(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as a chat completion's ``message.tool_calls`` (arguments as a JSON string)."""
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
