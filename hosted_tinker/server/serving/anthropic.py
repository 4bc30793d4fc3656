"""The Anthropic Messages API (``POST …/v1/messages``, ``…/v1/messages/count_tokens``), served by
the same sampler, names, slots, budgets and metering as the OpenAI routes (``serving.openai``).

A request becomes the model's own chat: the system prompt and the turns through its chat template
(consecutive turns of one role joined into one, as Anthropic's API does), and a final assistant
turn is a prefill the answer continues. ``stop_sequences`` stop it besides the model's end of turn.
Streaming sends Anthropic's events as tokens are sampled: ``message_start``, one text block's
``content_block_start`` / ``_delta``s / ``_stop``, ``message_delta`` with the stop reason and
usage, ``message_stop``.

What is not served is refused by name, never dropped: tool definitions and ``tool_use`` /
``tool_result`` blocks, extended ``thinking``, image and document blocks. ``cache_control`` on a
block is accepted (a caching hint: it changes no answer; nothing is cached between requests).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from jinja2 import TemplateError

from hosted_tinker.core.errors import ApiError, bad_request
from hosted_tinker.core.sampling import SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol.anthropic_types import CountTokensRequest, MessagesRequest, error_type
from hosted_tinker.server.serving.openai import OpenAIService, StreamedRow

TEXT_FIELDS = {"type", "text", "cache_control", "citations"}
NOT_SERVED = {
    "tool_use": "tool use is not served here yet",
    "tool_result": "tool use is not served here yet",
    "server_tool_use": "tool use is not served here yet",
    "image": "images are not read through the Messages API here (the Tinker SDK samples them on vision models)",
    "document": "documents are not read here",
    "thinking": "extended thinking is not served here",
    "redacted_thinking": "extended thinking is not served here",
}


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a message's (or the system prompt's) content: a string, or text blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and set(block) <= TEXT_FIELDS:
            parts.append(block["text"])
        elif kind in NOT_SERVED:
            raise bad_request(f"{where}[{j}]: a {kind} block: {NOT_SERVED[kind]}")
        elif kind == "text":
            raise bad_request(f"{where}[{j}]: a text block has a string text and no fields but {sorted(TEXT_FIELDS)}")
        else:
            raise bad_request(f"{where}[{j}]: {str(kind)[:40]!r} is not a content block type this server reads")
    return "".join(parts)


def chat(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, str]], str]:
    """The chat-template messages of a request, and the final assistant turn's text it prefills."""
    if req.tools:
        raise bad_request("tools: tool use is not served here yet (the chat templates' tool calls are not parsed)")
    if req.tool_choice is not None and req.tool_choice.get("type") not in ("auto", "none"):
        raise bad_request("tool_choice: names a tool, and tool use is not served here yet")
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise bad_request("thinking: extended thinking is not served here")
    messages: list[dict[str, str]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        text = _text(message.content, f"messages[{i}].content")
        if messages and messages[-1]["role"] == message.role:
            messages[-1]["content"] += "\n\n" + text  # Anthropic combines consecutive turns of one role
        else:
            messages.append({"role": message.role, "content": text})
    prefill = ""
    if messages[-1]["role"] == "assistant":
        prefill = messages.pop()["content"]
        if prefill != prefill.rstrip():
            raise bad_request("messages: the final assistant turn cannot end with white space (Anthropic's rule)")
    return messages, prefill


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


class AnthropicService:
    def __init__(self, openai: OpenAIService) -> None:
        self.openai = openai
        self.tokenizer = openai.tokenizer

    # ---- requests -> prompts and specs ------------------------------------------------------

    def _prompt(self, req: MessagesRequest | CountTokensRequest) -> list[int]:
        """The prompt's tokens, on the tokenizer's thread (``OpenAIService.on_tokenizer_thread``)."""
        messages, prefill = chat(req)
        self.openai.check_length(sum(len(m["content"]) for m in messages) + len(prefill), "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:  # the template's own raise_exception: what it wants of the messages
            raise bad_request(f"messages: the model's chat template refused them: {e}") from None
        return self.tokenizer.encode(text + prefill, add_special_tokens=False)

    async def _prepare(self, req: MessagesRequest) -> tuple[list[int], SampleSpec]:
        prompt = await self.openai.on_tokenizer_thread(self._prompt, req)
        params = wire.SamplingParams(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences or None,
            temperature=req.temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k if req.top_k is not None else -1,
        )
        spec = self.openai.sampling.spec(prompt, params, cost_field="prompt tokens + max_tokens")
        return prompt, self.openai.ends_turn(spec)

    async def count_tokens(self, req: CountTokensRequest, tenant: str) -> dict:
        self.openai.resolve(req.model, tenant)  # a model the key may not sample is a 404 here too
        with self.openai.slot(req.model, tenant):  # tokenizing a long prompt is work: bounded like a request
            prompt = await self.openai.on_tokenizer_thread(self._prompt, req)
        return {"input_tokens": len(prompt)}

    # ---- answers ----------------------------------------------------------------------------

    def _ending(self, seq: SampledSequence, spec: SampleSpec) -> tuple[str, str, str | None]:
        """A sampled answer's text, stop reason and the stop sequence that ended it, if one did."""
        text, stop = self.openai.visible_text(seq.tokens, spec)
        if stop is not None:
            return text, "stop_sequence", stop
        return text, ("end_turn" if seq.stop_reason == "stop" else "max_tokens"), None

    async def respond(self, req: MessagesRequest, tenant: str) -> dict:
        prompt, spec, output = await self.openai.complete(req.model, tenant, lambda: self._prepare(req))
        [seq] = output.sequences
        text, reason, stop = await self.openai.on_tokenizer_thread(self._ending, seq, spec)
        return {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": {"input_tokens": len(prompt), "output_tokens": len(seq.tokens)},
        }

    async def stream(self, req: MessagesRequest, tenant: str) -> AsyncIterator[str]:
        """Server-sent events as Anthropic sends them; a bad request is still a plain 4xx."""
        prompt, spec, events, task = await self.openai.start(req.model, tenant, lambda: self._prepare(req))
        return self._events(req, prompt, spec, events, task)

    async def _events(
        self, req: MessagesRequest, prompt: list[int], spec: SampleSpec, events: asyncio.Queue, task: asyncio.Future
    ) -> AsyncIterator[str]:
        message = {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prompt), "output_tokens": 0},
        }
        yield _event("message_start", {"message": message})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        row = StreamedRow()
        while (event := await events.get()) is not None:
            if text := self.openai.delta(row, event[1], spec):
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        try:
            output: SampleOutput = task.result()
        except Exception as e:
            status = e.status if isinstance(e, ApiError) else 500
            message_text = e.detail if isinstance(e, ApiError) else f"sampling failed: {type(e).__name__}"
            yield _event("error", {"error": {"type": error_type(status), "message": message_text}})
            return
        [seq] = output.sequences
        text, reason, stop = self._ending(seq, spec)
        if rest := text[len(row.sent) :]:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}})
        yield _event("content_block_stop", {"index": 0})
        delta = {"delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": {"output_tokens": len(seq.tokens)}}
        yield _event("message_delta", delta)
        yield _event("message_stop", {})
