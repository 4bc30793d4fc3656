"""The Anthropic Messages API (``POST …/v1/messages``, ``…/v1/messages/count_tokens``), served by
the same sampler, names, slots, budgets and metering as the OpenAI routes (``serving.openai``).

A request becomes the model's own chat: the system prompt and the turns through its chat template
(consecutive turns of one role joined into one, as Anthropic's API does), and a final assistant
turn is a prefill the answer continues. ``stop_sequences`` stop it besides the model's end of turn.
Streaming sends Anthropic's events as tokens are sampled: ``message_start``, one text block's
``content_block_start`` / ``_delta``s / ``_stop``, ``message_delta`` with the stop reason and
usage, ``message_stop``.

Tools, where the model's chat template takes them (``serving.tool_calls``): the definitions go to
the template, ``tool_use`` / ``tool_result`` blocks become its tool calls and tool turns, and
calls the model writes come back as ``tool_use`` blocks (``stop_reason`` ``tool_use``). What is
not served is refused by name, never dropped: a ``tool_choice`` that forces a call (no constrained
decoding here), server tools, extended ``thinking``, image and document blocks. ``cache_control``
is accepted (a caching hint: it changes no answer; nothing is cached between requests).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from jinja2 import TemplateError

from hosted_tinker.core.errors import ApiError, bad_request
from hosted_tinker.core.sampling import SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.server.protocol import anthropic_types as ant
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol.anthropic_types import CountTokensRequest, MessagesRequest, error_type
from hosted_tinker.server.serving.openai import OpenAIService, Prepare, StreamedRow
from hosted_tinker.server.serving.tool_calls import Schemas, ToolForm, schemas

TEXT_FIELDS = {"type", "text", "cache_control", "citations"}
TOOL_USE_FIELDS = {"type", "id", "name", "input", "cache_control"}
TOOL_RESULT_FIELDS = {"type", "tool_use_id", "content", "is_error", "cache_control"}
TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type"}
NOT_SERVED = {
    "image": "images are not read through the Messages API here (the Tinker SDK samples them on vision models)",
    "document": "documents are not read here",
    "thinking": "extended thinking is not served here",
    "redacted_thinking": "extended thinking is not served here",
    "server_tool_use": "server tools are not served here",
}

ANTHROPIC_NAMES = {"stop": "stop_sequences"}  # where a Messages field is not named as Tinker's


@dataclass
class Chat:
    """A request as the model's chat template takes it."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the template's (OpenAI-style) function list
    prefill: str = ""  # a final assistant turn's text, which the answer continues

    def characters(self) -> int:
        """What the prompt's text holds, before it is tokenized (``OpenAIService.check_length``)."""
        text = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in self.messages)
        return text + len(self.prefill) + (len(json.dumps(self.tools)) if self.tools else 0)


def _block(block: dict[str, Any], where: str, allowed: set[str], **kinds: type | tuple[type, ...]) -> None:
    if not set(block) <= allowed:
        unknown = sorted(set(block) - allowed)[0]
        raise bad_request(f"{where}: a {block['type']} block has no field {unknown[:40]!r}")
    for name, kind in kinds.items():
        if not isinstance(block.get(name), kind):
            raise bad_request(f"{where}.{name}: missing, or not of the type a {block['type']} block has")


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of the system prompt or a tool result: a string, or text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: a string or a list of text blocks, not {type(content).__name__}")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}[{j}]: only text blocks are read here, not {str(kind)[:40]!r}")
        _block(block, f"{where}[{j}]", TEXT_FIELDS, text=str)
        parts.append(block["text"])
    return "".join(parts)


def _turn(role: str, content: str | list[dict[str, Any]], where: str, chat: Chat, tools: bool) -> None:
    """One message's turns onto ``chat``: its text (joined to the turn before when that is of
    the same role, as Anthropic's API combines them), its tool calls and tool results."""
    text, calls, results = [], [], []
    for j, block in enumerate([{"type": "text", "text": content}] if isinstance(content, str) else content):
        kind, at = block.get("type"), f"{where}[{j}]"
        if not isinstance(kind, str):
            raise bad_request(f"{at}.type: a string naming the block's type")
        if kind == "text":
            _block(block, at, TEXT_FIELDS, text=str)
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            _block(block, at, TOOL_USE_FIELDS, id=str, name=str, input=dict)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block["input"]},
                }
            )
        elif kind == "tool_result" and role == "user":
            _block(block, at, TOOL_RESULT_FIELDS, tool_use_id=str)
            result = _text(block.get("content", ""), f"{at}.content")
            # How the model hears that a call failed: said in the result, as it can read it.
            results.append(f"Error: {result}" if block.get("is_error") else result)
        elif kind in ("tool_use", "tool_result"):
            raise bad_request(
                f"{at}: a {kind} block belongs in {'an assistant' if kind == 'tool_use' else 'a user'} turn"
            )
        elif kind in NOT_SERVED:
            raise bad_request(f"{at}: a {kind} block: {NOT_SERVED[kind]}")
        else:
            raise bad_request(f"{at}: {str(kind)[:40]!r} is not a content block type this server reads")
    if (calls or results) and not tools:
        raise bad_request(f"{where}: tool calls and results need a model whose chat template takes tools")
    chat.messages += [{"role": "tool", "content": result} for result in results]
    joined = "".join(text)
    last = chat.messages[-1] if chat.messages else None
    if last is not None and last["role"] == role and not results and not last.get("tool_calls") and not calls:
        last["content"] += "\n\n" + joined
    elif joined or calls or not results:
        chat.messages.append({"role": role, "content": joined} | ({"tool_calls": calls} if calls else {}))


def chat(req: MessagesRequest | CountTokensRequest, form: ToolForm | None) -> Chat:
    """What the model's chat template is given for a request; ``form``: how the template writes
    tool calls, None if it takes no tools (tools are then a 400)."""
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise bad_request("thinking: extended thinking is not served here")
    choice = (req.tool_choice or {}).get("type", "auto")
    if choice not in ("auto", "none"):
        raise bad_request(
            f"tool_choice: {str(choice)[:40]!r} would force a call, which is not served here (auto or none)"
        )
    out = Chat()
    if req.tools:
        if form is None:
            raise bad_request(
                "tools: this model's chat template takes no tools (or writes calls in a form not read here)"
            )
        out.tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") not in (None, "custom"):
                raise bad_request(f"tools[{i}]: {str(tool.get('type'))[:40]!r} is a server tool, not served here")
            if not set(tool) <= TOOL_FIELDS or not isinstance(tool.get("name"), str):
                raise bad_request(f"tools[{i}]: a tool has a name, a description and an input_schema")
            schema, description = tool.get("input_schema", {"type": "object"}), tool.get("description", "")
            if not isinstance(schema, dict) or not isinstance(description, str):
                raise bad_request(f"tools[{i}]: input_schema is an object (a JSON schema), description a string")
            function = {"name": tool["name"], "description": description, "parameters": schema}
            out.tools.append({"type": "function", "function": function})
        if choice == "none":  # the model is not told of them
            out.tools = None
    if req.system is not None:
        out.messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        _turn(message.role, message.content, f"messages[{i}].content", out, form is not None)
    final = out.messages[-1] if out.messages else None
    if final is not None and final["role"] == "assistant" and not final.get("tool_calls"):
        out.prefill = out.messages.pop()["content"]
        if out.prefill != out.prefill.rstrip():
            raise bad_request("messages: the final assistant turn cannot end with white space (Anthropic's rule)")
        if not out.messages:
            raise bad_request("messages: a turn to answer before the final assistant turn (which the answer continues)")
    return out


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


@dataclass
class _Prepared:
    prompt: list[int]
    spec: SampleSpec
    tools: Schemas | None  # the tools offered (calls are read out of the answer as they say), if any


# why a message ended, as the Messages API names it
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicService:
    def __init__(self, openai: OpenAIService) -> None:
        self.openai = openai
        self.tokenizer = openai.tokenizer

    # ---- requests -> prompts and specs ------------------------------------------------------

    def _chat(self, req: MessagesRequest | CountTokensRequest) -> tuple[list[int], Schemas | None]:
        """The prompt's tokens, and the schemas of the tools offered, if any; on the tokenizer's thread."""
        turns = chat(req, self.openai.tool_form)
        try:
            self.openai.check_length(turns.characters(), "messages")
            text = self.tokenizer.apply_chat_template(
                turns.messages, tools=turns.tools, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as e:  # the template's own raise_exception: what it wants of the messages
            raise bad_request(f"messages: the model's chat template refused them: {e}") from None
        except RecursionError:  # JSON within the body parser's bounds, nested past the template's
            raise bad_request("messages or tools: nested too deep to write into the prompt") from None
        offered = schemas(turns.tools) if turns.tools is not None else None
        return self.tokenizer.encode(text + turns.prefill, add_special_tokens=False), offered

    async def _prepare(self, req: MessagesRequest) -> _Prepared:
        prompt, tools = await self.openai.on_tokenizer_thread(self._chat, req)
        params = wire.SamplingParams(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences or None,
            temperature=req.temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k if req.top_k is not None else -1,
        )
        spec = self.openai.sampling.spec(
            prompt, params, cost_field="prompt tokens + max_tokens", field=lambda name: ANTHROPIC_NAMES.get(name, name)
        )
        return _Prepared(prompt, self.openai.ends_turn(spec), tools)

    def _preparer(self, req: MessagesRequest) -> tuple[list[_Prepared], Prepare]:
        """What ``OpenAIService.complete`` / ``start`` call to make the request ready, and the list
        that then holds what it made (whether tools were offered, which they do not carry)."""
        prepared: list[_Prepared] = []

        async def prepare() -> tuple[list[int], SampleSpec]:
            prepared.append(await self._prepare(req))
            return prepared[0].prompt, prepared[0].spec

        return prepared, prepare

    async def count_tokens(self, req: CountTokensRequest, tenant: str) -> ant.TokenCount:
        self.openai.resolve(req.model, tenant, audit=False)  # one the key may not sample is a 404 here too
        with self.openai.slot(req.model, tenant):  # tokenizing a long prompt is work: bounded like a request
            prompt, _ = await self.openai.on_tokenizer_thread(self._chat, req)
        return ant.TokenCount(input_tokens=len(prompt))

    # ---- answers ----------------------------------------------------------------------------

    def _content(self, seq: SampledSequence, ready: _Prepared) -> tuple[list[dict[str, Any]], StopReason, str | None]:
        """A sampled answer's content blocks (its text, then its tool calls), stop reason, and the
        stop sequence that ended it, if one did."""
        text, stop, calls = self.openai.read_answer(seq.tokens, ready.spec, ready.tools)
        blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
        blocks += [
            {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": c.name, "input": c.arguments}
            for c in calls
        ]
        if calls:
            return blocks, "tool_use", None
        if stop is not None:
            return blocks, "stop_sequence", stop
        return blocks, ("end_turn" if seq.stop_reason == "stop" else "max_tokens"), None

    def _message(
        self,
        req: MessagesRequest,
        prompt: list[int],
        answer: tuple[list[dict[str, Any]], StopReason, str | None] | None = None,
        output_tokens: int = 0,
    ) -> ant.Message:
        """The message with ``answer`` (``_content``'s), or before it: a stream's ``message_start``."""
        blocks, reason, stop = answer if answer is not None else ([], None, None)
        return ant.Message.model_validate(
            {
                "id": f"msg_{secrets.token_hex(12)}",
                "model": req.model,
                "content": blocks,  # each block's dict is checked as its type's model
                "stop_reason": reason,
                "stop_sequence": stop,
                "usage": ant.Usage(input_tokens=len(prompt), output_tokens=output_tokens),
            }
        )

    async def respond(self, req: MessagesRequest, tenant: str) -> ant.Message:
        prepared, prepare = self._preparer(req)
        prompt, _, output = await self.openai.complete(req.model, tenant, prepare)
        [seq] = output.sequences
        answer = await self.openai.on_tokenizer_thread(self._content, seq, prepared[0])
        return self._message(req, prompt, answer, len(seq.tokens))

    async def stream(self, req: MessagesRequest, tenant: str) -> AsyncIterator[str]:
        """Server-sent events as Anthropic sends them; a bad request is still a plain 4xx."""
        prepared, prepare = self._preparer(req)
        prompt, _, events, task = await self.openai.start(req.model, tenant, prepare)
        return self._events(req, prompt, prepared[0], events, task)

    async def _events(
        self, req: MessagesRequest, prompt: list[int], ready: _Prepared, events: asyncio.Queue, task: asyncio.Future
    ) -> AsyncIterator[str]:
        yield _event("message_start", {"message": self._message(req, prompt).model_dump()})
        # Text is sent as it is sampled, up to where a tool call may begin; each call once read
        # whole. The text block starts with its first text, so an answer that is only calls
        # streams the blocks that it has when not streamed.
        shown, keep = self.openai.streamed_spec(ready.spec, ready.tools)
        row, started = StreamedRow(), False
        while (event := await events.get()) is not None:
            if text := self.openai.delta(row, event[1], shown, keep):
                if not started:
                    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    started = True
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        try:
            output: SampleOutput = task.result()
        except Exception as e:
            status = e.status if isinstance(e, ApiError) else 500
            message = e.detail if isinstance(e, ApiError) else f"sampling failed: {type(e).__name__}"
            yield _event("error", {"error": {"type": error_type(status), "message": message}})
            return
        [seq] = output.sequences
        blocks, reason, stop = await self.openai.on_tokenizer_thread(self._content, seq, ready)
        if blocks and blocks[0]["type"] == "text":
            if not started:
                yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                started = True
            if rest := blocks[0]["text"][len(row.sent) :]:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}})
        if started:
            yield _event("content_block_stop", {"index": 0})
        for index, block in enumerate((b for b in blocks if b["type"] == "tool_use"), start=int(started)):
            yield _event("content_block_start", {"index": index, "content_block": block | {"input": {}}})
            partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield _event("content_block_delta", {"index": index, "delta": partial})
            yield _event("content_block_stop", {"index": index})
        delta: dict[str, Any] = {
            "delta": {"stop_reason": reason, "stop_sequence": stop},
            "usage": {"output_tokens": len(seq.tokens)},
        }
        yield _event("message_delta", delta)
        yield _event("message_stop", {})
