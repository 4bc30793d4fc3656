"""What the ``/v1`` proxy changes in a request on its way to vLLM and in the answer on its way
back, besides model names (``openai_proxy``): the usage it meters, greedy copies, and the routing
vLLM returns for routing replay.

They read and rewrite vLLM's JSON (a whole answer, or a stream's ``data:`` lines, which
``openai_proxy`` hands over whole), only when they have to: the meter parses the one event
that holds a usage object; copies parse every event, but only of a request that needs them;
routing is taken out of a whole answer that holds it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hosted_tinker.inference.vllm_engine import GREEDY_BELOW
from hosted_tinker.server.serving.usage import Charge, UsageLedger

# A usage object, not vLLM's "usage":null on every chunk of a stream that asked for usage (each
# would then be parsed here). Text that a model wrote is escaped: it holds \"usage\", never this.
USAGE = re.compile(rb'"usage":\s*\{')
# vLLM's routed experts of a choice (``vllm_engine.recorded_routing``), not its null
ROUTED = re.compile(rb'"routed_experts":\s*"')
SAMPLING_PATHS = ("completions", "chat/completions")  # whose n and stream_options are OpenAI's
MAX_COPIES = 128  # the n the embedded engine's /v1 accepts (protocol.openai_types)
_BOOL = TypeAdapter(bool)


class Meter:
    """What one forwarded request sampled, into the usage ledger (``serving.usage``): vLLM's own
    count, from a JSON answer's ``usage``, or from the event a stream ends with: the usage event
    of a completion (asked for with ``asks`` even when the client did not, and then taken out,
    so the client sees what it would have without us), ``response.completed`` of a response. A
    stream the client leaves before its end is not counted: vLLM sends its count last."""

    def __init__(self, ledger: UsageLedger | None, charge: Charge, payload: dict, path: str) -> None:
        self.ledger, self.charge = ledger, charge
        options = payload.get("stream_options")
        streamed = path in SAMPLING_PATHS and lax_bool(payload.get("stream"))
        asked = isinstance(options, dict) and lax_bool(options.get("include_usage"))
        # A stream_options vLLM would refuse is left for it to refuse.
        self.hide = streamed and (options is None or isinstance(options, dict)) and not asked
        self.asks = {"stream_options": {**(options or {}), "include_usage": True}} if self.hide else {}

    def count_answer(self, content: bytes) -> None:
        """A whole JSON answer (off the loop when large)."""
        if USAGE.search(content):
            self._count(_json_or_none(content))

    def count_events(self, lines: bytes) -> bytes:
        """Whole lines of a stream that hold a usage object somewhere: the final event (a
        completion's with no choices, where with ``continuous_usage_stats`` every chunk has a
        running count too; a response's ``response.completed``) is counted, and a usage event
        only we asked for is taken out with its blank line."""
        kept: list[bytes] = []
        dropped = False
        for line in lines.split(b"\n"):
            if dropped and line == b"":
                dropped = False
                continue
            if line.startswith(b"data: {") and USAGE.search(line):
                event = _json_or_none(line[len(b"data: ") :])
                final = isinstance(event, dict) and (
                    event.get("choices") == [] or event.get("type") == "response.completed"
                )
                if final and self._count(event) and self.hide:
                    dropped = True
                    continue
            kept.append(line)
        return b"\n".join(kept)

    def _count(self, answer: Any) -> bool:
        """Whether ``answer`` holds vLLM's usage (then in the ledger): a completion's (prompt and
        completion tokens), or a response's (input and output tokens, in it or its ``response``)."""
        if not isinstance(answer, dict):
            return False
        inner = answer.get("response")
        usage = answer.get("usage") or (inner.get("usage") if isinstance(inner, dict) else None)
        if not isinstance(usage, dict):
            return False
        if self.ledger is not None:
            prompt = _tokens(usage, "prompt_tokens") or _tokens(usage, "input_tokens")
            completion = _tokens(usage, "completion_tokens") or _tokens(usage, "output_tokens")
            self.ledger.sampled(self.charge, prompt, completion)
        return True


def lax_bool(value: Any) -> bool:
    """``value`` as vLLM's models read a bool (pydantic's lax mode: "true", 1, "on" are True);
    False for what they would refuse."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def _tokens(usage: dict, field: str) -> int:
    value = usage.get(field)
    return value if type(value) is int and value >= 0 else 0


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class GreedyCopies:
    """OpenAI's API gives ``n`` choices at temperature 0 (all the same one); vLLM refuses n > 1
    there. So vLLM is asked for one (``asks``) and each of its choices is copied ``n`` times (at
    most ``MAX_COPIES``: a larger n is left for vLLM to refuse),
    indexed as vLLM would have (a choice of prompt ``p`` is ``p * n + i``), and usage counted
    as for ``n`` (as the embedded engine and the Tinker API count greedy samples)."""

    def __init__(self, payload: dict, path: str) -> None:
        n, temperature = payload.get("n"), payload.get("temperature")
        # numbers, not booleans (JSON's true is no temperature)
        greedy = (
            isinstance(temperature, int | float)
            and not isinstance(temperature, bool)
            and 0 <= temperature < GREEDY_BELOW
        )
        # Beam search reads n as its width; best_of asks for more than n to choose from.
        alone = not lax_bool(payload.get("use_beam_search")) and payload.get("best_of") in (None, 1)
        wanted = path in SAMPLING_PATHS and greedy and alone and type(n) is int and 1 < n <= MAX_COPIES
        self.n: int = n if wanted and type(n) is int else 1
        self.asks = {"n": 1} if self.n > 1 else {}

    def answer(self, content: bytes) -> bytes:
        """A whole JSON answer (off the loop when large)."""
        answer = _json_or_none(content)
        return json.dumps(self._copied(answer)).encode() if isinstance(answer, dict) else content

    def events(self, lines: bytes) -> bytes:
        """Whole lines of a stream: each event's choices copied."""
        out = []
        for line in lines.split(b"\n"):
            if line.startswith(b"data: {") and isinstance(event := _json_or_none(line[len(b"data: ") :]), dict):
                line = b"data: " + json.dumps(self._copied(event)).encode()
            out.append(line)
        return b"\n".join(out)

    def _copied(self, answer: dict) -> dict:
        choices = answer.get("choices")
        if isinstance(choices, list):
            answer["choices"] = [
                {**c, "index": c.get("index", 0) * self.n + i} if isinstance(c, dict) else c
                for c in choices
                for i in range(self.n)
            ]
        usage = answer.get("usage")
        if isinstance(usage, dict) and type(completion := usage.get("completion_tokens")) is int:
            usage["completion_tokens"] = completion * self.n
            if type(total := usage.get("total_tokens")) is int:
                usage["total_tokens"] = total + completion * (self.n - 1)
        return answer


def asks_routing(payload: dict) -> bool:
    """Whether a request asks vLLM for its routed experts (vLLM's own field, which only a client that
    knows vLLM sends): a vLLM started to return them for routing replay (``--vllm-routing``) returns
    them with every answer, which the proxy otherwise takes out (``without_routing``)."""
    return "routed_experts_prompt_start" in payload


def least_routing(payload: dict, path: str) -> dict:
    """What a request that asks no routing adds for a vLLM that returns it (``--vllm-routing
    record``): a completion of one prompt of token ids starts it at the first sampled token, the
    least vLLM sends (a text or chat prompt's length in tokens is not known here: none)."""
    prompt = payload.get("prompt")
    if path != "completions" or asks_routing(payload) or not isinstance(prompt, list) or not prompt:
        return {}
    if not all(type(token) is int for token in prompt):
        return {}
    return {"routed_experts_prompt_start": len(prompt)}


def without_routing(content: bytes) -> bytes:
    """A whole JSON answer without its choices' ``routed_experts`` (off the loop when large): each
    is ``layers x top_k`` bytes a token, in base64, which an OpenAI client did not ask for."""
    if not ROUTED.search(content):
        return content
    answer = _json_or_none(content)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        return content
    for choice in choices:
        if isinstance(choice, dict):
            choice.pop("routed_experts", None)
    return json.dumps(answer).encode()
