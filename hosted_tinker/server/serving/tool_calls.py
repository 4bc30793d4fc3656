"""Tool calls as a model's chat template writes them: which form a template uses, and the calls
read back out of sampled text. Pure functions; the API doors (``serving.anthropic``) turn them
into their own blocks.

Two forms are read, the ones the lineup's templates write:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and the built-in tiny model): ``<tool_call>`` then a JSON
  object ``{"name": ..., "arguments": {...}}`` then ``</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call>`` ``<function=NAME>`` then one
  ``<parameter=KEY>`` VALUE ``</parameter>`` per argument, ``</function>`` ``</tool_call>``;
  a value is JSON where it parses as JSON, else the string.

A template that takes no ``tools``, or writes calls in another form, has none: asking for tools
on it is refused (a model given tools it cannot call would answer as if it had none).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ToolForm = Literal["hermes", "qwen3_coder"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # a call's markers, in both forms
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_form(chat_template: str | None) -> ToolForm | None:
    """The form in which ``chat_template`` writes tool calls, None if it takes no tools."""
    if not chat_template or "tools" not in chat_template or OPEN not in chat_template:
        return None
    return "qwen3_coder" if "<function=" in chat_template else "hermes"


def _hermes(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(call["name"], arguments) if isinstance(arguments, dict) else None


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _qwen3_coder(body: str) -> ToolCall | None:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, params = function.group(1).strip(), function.group(2)
    return ToolCall(name, {key.strip(): _value(value) for key, value in _PARAMETER.findall(params)})


def parse(text: str, form: ToolForm) -> tuple[str, list[ToolCall]]:
    """The text before the first call, and the calls, of sampled ``text``. If any call does not
    parse (a malformed one, or one cut off by ``max_tokens``), the whole text is text: a call is
    never made up from a part of one."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    bodies = _CALL.findall(text, start)
    rest = _CALL.sub("", text[start:]).strip()
    read = _hermes if form == "hermes" else _qwen3_coder
    calls = [read(body.strip() if form == "hermes" else body) for body in bodies]
    if not calls or rest or any(call is None for call in calls):
        return text, []
    return text[:start].rstrip(), [call for call in calls if call is not None]
