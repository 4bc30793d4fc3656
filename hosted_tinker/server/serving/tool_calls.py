"""Tool calls as a model's chat template writes them: which form a template uses, and the calls
read back out of sampled text. Pure functions; the API doors (``serving.anthropic``) turn them
into their own blocks.

Two forms are read, the ones the lineup's templates write:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and the built-in tiny model): ``<tool_call>`` then a JSON
  object ``{"name": ..., "arguments": {...}}`` then ``</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call>`` ``<function=NAME>`` then one
  ``<parameter=KEY>`` VALUE ``</parameter>`` per argument, ``</function>`` ``</tool_call>``;
  a value is the text as written where the tool's schema says the parameter is a string (``"007"``
  stays ``"007"``), else JSON where it parses as JSON, else the string (as vLLM's parser reads them).

A template that takes no ``tools``, or writes calls in another form, has none: asking for tools
on it is refused (a model given tools it cannot call would answer as if it had none).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

ToolForm = Literal["hermes", "qwen3_coder"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # a call's markers, in both forms
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
MAX_CALLS = 64  # an answer with more is text: no client asks for that many at once
MAX_PARAMETERS = 256


# Per tool offered, its parameters' JSON schemas (``properties``): what a written value is read as.
Schemas = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def schemas(tools: list[dict[str, Any]]) -> Schemas:
    """The parameter schemas of ``tools`` as a chat template takes them (``{"type": "function",
    "function": {"name", "parameters"}}``)."""
    out: Schemas = {}
    for tool in tools:
        function = tool.get("function")
        if not isinstance(function, dict):
            function = tool
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        name = function.get("name")
        if isinstance(name, str):
            out[name] = properties if isinstance(properties, dict) else {}
    return out


def _is_text(schema: Any) -> bool:
    """Whether a parameter's schema says its value is a string (and nothing but, or null)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return isinstance(kinds, list) and "string" in kinds and all(k in ("string", "null") for k in kinds)


def tool_form(chat_template: str | None) -> ToolForm | None:
    """The form in which ``chat_template`` writes tool calls, None if it takes no tools."""
    if not chat_template or "tools" not in chat_template or OPEN not in chat_template:
        return None
    return "qwen3_coder" if FUNCTION in chat_template else "hermes"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON has no infinity to send it back as
        raise ValueError(text)
    return value


def _refused(constant: str) -> Any:
    raise ValueError(constant)  # NaN, Infinity: not JSON, though Python's parser takes them


def _json(text: str) -> Any:
    """``text`` as strict JSON (finite numbers only); ValueError otherwise, also for nesting
    deeper than the parser's recursion allows."""
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_refused)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _pairs(text: str, open_: str, close: str, limit: int) -> tuple[list[str], list[str]] | None:
    """The bodies between each ``open_`` and its ``close`` in ``text`` (which starts at an
    ``open_``), and the pieces between them; None if one is never closed, or past ``limit``.
    One pass over the text: each search starts where the last ended."""
    bodies: list[str] = []
    between: list[str] = []
    at = 0
    while (start := text.find(open_, at)) >= 0:
        between.append(text[at:start])
        end = text.find(close, start + len(open_))
        if end < 0 or len(bodies) == limit:
            return None
        bodies.append(text[start + len(open_) : end])
        at = end + len(close)
    between.append(text[at:])
    return bodies, between


def _hermes(body: str) -> ToolCall | None:
    try:
        call = _json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _json(arguments)
        except ValueError:
            return None
    return ToolCall(call["name"], arguments) if isinstance(arguments, dict) else None


def _value(text: str) -> Any:
    try:
        return _json(text)
    except ValueError:
        return text


def _qwen3_coder(body: str, known: Schemas) -> ToolCall | None:
    body = body.strip()
    if not body.startswith(FUNCTION) or not body.endswith(END_FUNCTION):
        return None
    name, newline, params = body[len(FUNCTION) : -len(END_FUNCTION)].partition(">")
    if not newline or "\n" in name or not name.strip():
        return None
    found = _pairs(params, PARAMETER, END_PARAMETER, MAX_PARAMETERS)
    if found is None or any(piece.strip() for piece in found[1]):
        return None
    arguments, properties = {}, known.get(name.strip(), {})
    for param in found[0]:
        key, closed, value = param.partition(">")
        if not closed or "\n" in key:
            return None
        text = value.removeprefix("\n").removesuffix("\n")
        arguments[key.strip()] = text if _is_text(properties.get(key.strip())) and text != "null" else _value(text)
    return ToolCall(name.strip(), arguments)


def parse(text: str, form: ToolForm, known: Schemas | None = None) -> tuple[str, list[ToolCall]]:
    """The text before the first call, and the calls, of sampled ``text`` (``known``: the
    offered tools' parameter schemas, which say how a ``qwen3_coder`` value reads). If any call does not
    parse (a malformed one, one cut off by ``max_tokens``, more than ``MAX_CALLS``), or words
    stand between or after them, the whole text is text: a call is never made up from a part
    of one. Linear in the text's length, whatever the model writes."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    found = _pairs(text[start:], OPEN, CLOSE, MAX_CALLS)
    if found is None or any(piece.strip() for piece in found[1]):
        return text, []
    known = known or {}
    calls = [_hermes(body.strip()) if form == "hermes" else _qwen3_coder(body.strip(), known) for body in found[0]]
    if any(call is None for call in calls):
        return text, []
    return text[:start].rstrip(), [call for call in calls if call is not None]
