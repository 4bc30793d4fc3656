"""OpenAI-compatible completions and chat completions, served by the same sampler as Tinker.

Model names: a served base-model name samples the base model; a ``tinker://…/sampler_weights/…``
(or ``…/weights/…``) path, alone or as the service's ``<base model>;<path>``, or the id of an
ephemeral sampling session, samples that adapter;
with vLLM, a training run's model id samples its adapter as of its latest optimizer step.
Streaming is real: tokens reach the client as the engine produces them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from jinja2 import TemplateError

from hosted_tinker.core.checkpoints import CheckpointError, TinkerPath
from hosted_tinker.core.errors import ApiError, bad_request
from hosted_tinker.core.sampling import SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.inference.engine import WeightsRef
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import openai_types as oai
from hosted_tinker.server.protocol.openai_types import ChatCompletionRequest, CompletionRequest
from hosted_tinker.server.serving.detokenize import IncrementalText, StopSearch
from hosted_tinker.server.serving.openai_chat import chat_messages, offered_tools, tool_call_entries
from hosted_tinker.server.serving.openai_logprobs import chat_logprobs, completion_logprobs
from hosted_tinker.server.serving.sampling import SamplingService
from hosted_tinker.server.serving.tenancy import Tenancy
from hosted_tinker.server.serving.tool_calls import CLOSE, OPEN, Schemas, ToolCall, parse, tool_form
from hosted_tinker.server.serving.usage import Charge

T = TypeVar("T")
# A request made ready to sample, on the tokenizer's thread: its prompt tokens and spec (or a 4xx).
Prepare = Callable[[], Awaitable[tuple[list[int], SampleSpec]]]

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
# Text longer than this many characters per token of context is refused before it is tokenized
# (no token of a real vocabulary is that long on average): a prompt costs its tokenizer's time
# and memory (GBs for tens of MB of text) before its token count is known.
MAX_CHARS_PER_TOKEN = 32


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model {name!r} does not exist", code="model_not_found")


@dataclass
class StreamedRow:
    """One streamed choice: its tokens so far, their visible text, and how much of it was sent."""

    tokens: list[int] = field(default_factory=list)
    sent: str = ""
    stopped_at: int | None = None  # text length where a stop string cut it
    text: IncrementalText = field(default_factory=IncrementalText)
    search: StopSearch | None = None  # made with the row's first token, from its spec's stop strings


class OpenAIService:
    def __init__(
        self,
        sampling: SamplingService,
        store: Store,
        tenancy: Tenancy,
        served_names: list[str],
        live_runs: bool = False,
    ) -> None:
        self.sampling = sampling
        self.tenancy = tenancy
        self.live_runs = live_runs  # training run ids name their live adapters (vLLM only)
        self.store = store
        self.served_names = served_names
        self.tokenizer = sampling.tokenizer
        # How the chat template writes tool calls (None: it takes no tools), and their markers,
        # kept in decoded text where a tokenizer makes them special tokens.
        self.tool_form = tool_form(getattr(self.tokenizer, "chat_template", None))
        self.tool_markers = (OPEN, CLOSE) if self.tool_form is not None else ()
        # Prompts are tokenized, and whole answers' texts and logprobs built, off the event loop
        # (a fast tokenizer lets go of the GIL), on a thread of their own: one at a time (a fast
        # tokenizer's settings are shared state that concurrent calls could find half-changed),
        # and not in the pool every other to_thread waits on.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    # ---- models -----------------------------------------------------------------------------

    def list_models(self, tenant: str) -> oai.OpenAIModelList:
        """The base model's names and what ``tenant`` may sample: its saved sampler weights, its
        sampling sessions, and (with vLLM) its live training runs."""
        names = list(self.served_names)
        names += [
            str(TinkerPath(c.model_id, c.kind, c.name))
            for c in self.store.owned_checkpoints(tenant)
            if c.kind == "sampler_weights"
        ]
        names += self.store.ephemeral_sampler_ids(tenant)
        if self.live_runs:
            names += self.store.live_model_ids(tenant)
        now = int(time.time())
        return oai.OpenAIModelList(data=[oai.OpenAIModel(id=n, created=now, owned_by="hosted-tinker") for n in names])

    def charge(self, tenant: str) -> Charge:
        """What a /v1 request uses counts against its key, in no session, on the served base model."""
        return Charge(tenant, "", self.served_names[0])

    def slot(self, name: str, tenant: str) -> AbstractContextManager[None]:
        """A place for one request on model ``name`` under the server's queue bounds (429 when
        none is free), counted per tenant and model like a sampling session's requests."""
        return self.sampling.scheduler.slot(f"{tenant}/v1/{name}", owner=tenant)

    def resolve(self, name: str, tenant: str, audit: bool = True) -> WeightsRef:
        """The weights a ``model`` name stands for, if ``tenant`` may sample them (else a 404);
        ``audit``: another key's checkpoint is read to sample it (not to count tokens)."""
        if name in self.served_names:
            return WeightsRef(None)
        base, semicolon, checkpoint = name.partition(";")
        if semicolon:
            # The service's "<base model>;<checkpoint path>": the checkpoint on that base, with the
            # context length its name carries. Ours carry none: each base runs at --max-seq-len.
            if base not in self.served_names:
                raise model_not_found(base)
            return self._checkpoint(checkpoint, tenant, audit, base)
        if name.startswith("tinker://"):
            return self._checkpoint(name, tenant, audit)
        sampler = self.store.get_sampler(name)
        if sampler is not None and self.tenancy.owns(tenant, name) and self.tenancy.may_sample(tenant, sampler):
            return self.sampling.weights_of(sampler)
        model = self.store.get_model(name)
        if (
            self.live_runs
            and model is not None
            and model.status in ("active", "parked")
            and self.tenancy.owns(tenant, name)
        ):
            return WeightsRef(None, live=name)  # the run's adapter as of its latest step
        raise model_not_found(name)

    def _checkpoint(self, name: str, tenant: str, audit: bool, base: str | None = None) -> WeightsRef:
        """The checkpoint at ``tinker://`` path ``name``, if ``tenant`` may read it (else a 404),
        trained on a base this server serves (all of its names are one model), or on ``base``."""
        try:
            path = TinkerPath.parse(name)
        except CheckpointError:
            raise model_not_found(name) from None
        model = self.store.get_model(path.run_id)
        if (
            model is None
            or self.store.get_checkpoint(path.run_id, path.kind, path.name) is None
            or not self.tenancy.can_read(tenant, path)
        ):
            raise model_not_found(name)
        if model.base_model not in self.served_names:
            against = f", not on {base!r}" if base is not None else ""
            raise bad_request(
                f"{name} was trained on {model.base_model!r}{against}: this server serves {self.served_names}"
            )
        if self.sampling.files.encrypted(path):
            raise bad_request(f"{name} is encrypted to its recipients: it cannot be sampled here")
        if audit and self.tenancy.audit is not None:
            self.tenancy.audit.read(path, tenant, "sample")
        return WeightsRef(name, self.sampling.files, path)

    # ---- requests -> specs ------------------------------------------------------------------

    def _spec(
        self, req: CompletionRequest | ChatCompletionRequest, prompt: list[int], max_tokens: int | None, topk: int
    ) -> SampleSpec:
        if req.presence_penalty or req.frequency_penalty:
            raise bad_request("presence_penalty and frequency_penalty are not supported (only 0)")
        params = wire.SamplingParams(
            max_tokens=max_tokens,
            seed=req.seed,
            stop=req.stop,  # None keeps EOS stopping; strings are stop strings
            temperature=req.temperature,
            top_p=req.top_p,
        )
        max_field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        spec = self.sampling.spec(
            prompt,
            params,
            num_samples=req.n,
            topk_sample_logprobs=topk,
            cost_field=f"n * (prompt tokens + {max_field})",
            field=lambda name: max_field if name == "max_tokens" else name,  # OpenAI's names are Tinker's
        )
        # Stop strings stop it besides the end of turn; ``stop: []`` turns stopping off, as a Tinker
        # ``stop`` does (a run of exactly max_tokens: what load tests and the fairness tests ask for).
        return self.ends_turn(spec) if req.stop else spec

    def ends_turn(self, spec: SampleSpec) -> SampleSpec:
        """``spec``, stopping at the model's end of turn too: an OpenAI ``stop`` or an Anthropic
        ``stop_sequences`` adds stops (where a Tinker ``stop`` replaces the end-of-sequence one)."""
        return dataclasses.replace(spec, stop_token_ids=spec.stop_token_ids | self.sampling.eos_token_ids)

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        if req.echo:
            raise bad_request("echo is not supported")
        if isinstance(req.prompt, str):
            self.check_length(len(req.prompt), "prompt")
            return self.tokenizer.encode(req.prompt, add_special_tokens=False)
        return list(req.prompt)

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages, tools = chat_messages(req, self.tool_form)
        try:
            calls = (json.dumps(m.get("tool_calls", "")) for m in messages)
            self.check_length(sum(len(m["content"]) for m in messages) + sum(map(len, calls)), "messages")
            self.check_length(len(json.dumps(tools)) if tools else 0, "tools")
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except TemplateError as e:  # the template's own raise_exception: what it wants of the messages
            raise bad_request(f"messages: the model's chat template refused them: {e}") from None
        except RecursionError:  # JSON within the body parser's bounds, nested past the template's
            raise bad_request("messages or tools: nested too deep to write into the prompt") from None

    def check_length(self, chars: int, field: str) -> None:
        context = self.sampling.backend.capabilities.max_seq_len
        if chars > MAX_CHARS_PER_TOKEN * context:
            raise bad_request(
                f"{field} has {chars} characters, more than {MAX_CHARS_PER_TOKEN} per token of the "
                f"{context}-token context"
            )

    # ---- text -------------------------------------------------------------------------------

    def visible_text(self, tokens: list[int], spec: SampleSpec, keep: tuple[str, ...] = ()) -> tuple[str, str | None]:
        """Visible text of ``tokens``: without a final stop token, cut before the first stop
        string in it, which is returned too (None when no stop string cut it). Special tokens
        are left out but for those in ``keep`` (a tool call's markers, which some tokenizers
        make special)."""
        if tokens and tokens[-1] in spec.stop_token_ids:
            tokens = tokens[:-1]
        if keep:  # what skip_special_tokens leaves out, but the kept ones
            hidden = self._hidden_ids(keep)
            text = self.tokenizer.decode([t for t in tokens if t not in hidden], skip_special_tokens=False)
        else:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [(text.find(s), s) for s in spec.stop_strings if s in text]
        if not cuts:
            return text, None
        at, stop = min(cuts)
        return text[:at], stop

    @functools.cache  # noqa: B019 - one service per server, a few ``keep`` tuples
    def _hidden_ids(self, keep: tuple[str, ...]) -> frozenset[int]:
        """The special tokens' ids (as ``skip_special_tokens`` knows them) but those of ``keep``."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        special = {i for i, token in added.items() if getattr(token, "special", False)}
        kept = {self.tokenizer.convert_tokens_to_ids(token) for token in keep}
        return frozenset(special | set(self.tokenizer.all_special_ids)) - kept

    def read_answer(
        self, tokens: list[int], spec: SampleSpec, tools: Schemas | None
    ) -> tuple[str, str | None, list[ToolCall]]:
        """An answer's visible text, the stop string that cut it, and the tool calls it wrote
        (read only when the model was told of ``tools``, whose schemas say how their values read;
        the text is then what comes before them)."""
        if tools is None or self.tool_form is None:
            text, stop = self.visible_text(tokens, spec)
            return text, stop, []
        text, stop = self.visible_text(tokens, spec, self.tool_markers)
        text, calls = parse(text, self.tool_form, tools)
        return text, stop, calls

    def streamed_spec(self, spec: SampleSpec, tools: Schemas | None) -> tuple[SampleSpec, tuple[str, ...]]:
        """What ``delta`` streams text with: with tools, up to where a call may begin (a call is
        sent once read whole), its markers kept; the spec the engine samples is not changed."""
        if tools is None or self.tool_form is None:
            return spec, ()
        return dataclasses.replace(spec, stop_strings=(*spec.stop_strings, OPEN)), self.tool_markers

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _token_str(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def delta(self, row: StreamedRow, token: int, spec: SampleSpec, keep: tuple[str, ...] = ()) -> str:
        """The text ``token`` adds to a streamed ``row`` that may be sent now: none past a stop
        string, none that may still turn out to begin one, no half of a multi-byte character.
        What ``visible_text`` of the row's tokens says, found a few tokens at a time
        (``serving.detokenize``)."""
        row.tokens.append(token)
        if row.stopped_at is not None or token in spec.stop_token_ids:  # a stop token ends it, unseen
            return ""
        if row.search is None:
            row.search = StopSearch(tuple(spec.stop_strings))
        if token not in self._hidden_ids(keep):
            row.text.add(self._decode, token)
        text, cut = row.text.text, row.search(row.text.text)
        stop = None
        if cut is not None:
            text, stop = text[: cut[0]], cut[1]
        hold = max((len(s) for s in spec.stop_strings), default=1) - 1  # text that may begin a stop string
        safe = text if stop is not None else text[: len(text) - hold] if hold else text
        if safe.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return ""
        if keep:  # white space before a call is not the answer's (``tool_calls.parse``): held until words follow
            safe = safe.rstrip()
        if stop is not None:
            row.stopped_at = len(text)
        if len(safe) <= len(row.sent):
            return ""
        new, row.sent = safe[len(row.sent) :], safe
        return new

    @staticmethod
    def _usage(prompt: list[int], output: SampleOutput | list[StreamedRow]) -> dict:
        rows = output.sequences if isinstance(output, SampleOutput) else output
        completion = sum(len(r.tokens) for r in rows)
        return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}

    @staticmethod
    def _finish_reason(seq: SampledSequence) -> Literal["stop", "length"]:
        return "stop" if seq.stop_reason == "stop" else "length"

    async def on_tokenizer_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, functools.partial(fn, *args))

    async def _prepare(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], SampleSpec]:
        """The prompt tokens and sampling spec of a request (validated: a 4xx before any output),
        tokenized on the tokenizer's thread: a long prompt does not hold up the event loop, and
        with it every other request. Called with the request's slot held, so that what waits
        for that thread is bounded by the queue bounds."""
        if isinstance(req, ChatCompletionRequest):
            prompt = await self.on_tokenizer_thread(self._chat_prompt, req)
            topk = (req.top_logprobs or 0) if req.logprobs else 0
            return prompt, self._spec(req, prompt, req.max_completion_tokens or req.max_tokens, topk)
        prompt = await self.on_tokenizer_thread(self._completion_prompt, req)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        return prompt, self._spec(req, prompt, max_tokens, req.logprobs or 0)

    # ---- non-streaming ----------------------------------------------------------------------

    async def respond(
        self, req: CompletionRequest | ChatCompletionRequest, tenant: str
    ) -> oai.Completion | oai.ChatCompletion:
        """A whole completion or chat completion: every choice, its text, logprobs and usage."""
        prompt, spec, output = await self.complete(req.model, tenant, lambda: self._prepare(req))
        # The texts and logprobs of many long choices: a tokenizer.decode per token and per alternative.
        return await self.on_tokenizer_thread(self._answer, req, prompt, spec, output)

    async def complete(self, model: str, tenant: str, prepare: Prepare) -> tuple[list[int], SampleSpec, SampleOutput]:
        """Sample what ``prepare`` makes of a request (its prompt and spec, a 4xx if it is not
        valid) on the weights ``model`` names, under a slot (429 when none is free) and the
        key's sampling budget, charged to ``tenant``. Every door's non-streamed answers run here."""
        weights = self.resolve(model, tenant)
        with self.slot(model, tenant), ExitStack() as reserved:
            prompt, spec = await prepare()
            reserved.callback(self.sampling.reserve(tenant, spec))
            output = await self.sampling.run(weights, spec, charge=self.charge(tenant))
        return prompt, spec, output

    def _answer(
        self, req: CompletionRequest | ChatCompletionRequest, prompt: list[int], spec: SampleSpec, output: SampleOutput
    ) -> oai.Completion | oai.ChatCompletion:
        chat = isinstance(req, ChatCompletionRequest)
        tools = offered_tools(req) if isinstance(req, ChatCompletionRequest) else None
        choices: list = []
        for i, seq in enumerate(output.sequences):
            text, _, calls = self.read_answer(seq.tokens, spec, tools)
            finish: Literal["tool_calls", "stop", "length"] = "tool_calls" if calls else self._finish_reason(seq)
            if chat:
                entries = [oai.ToolCallOut.model_validate(c) for c in tool_call_entries(calls)] if calls else None
                message = oai.AssistantMessage(content=text or (None if calls else ""), tool_calls=entries)
                chat_lps = chat_logprobs(seq, self._token_str) if req.logprobs else None
                choices.append(oai.ChatChoice(index=i, finish_reason=finish, message=message, logprobs=chat_lps))
            else:
                text_lps = completion_logprobs(seq, self._token_str) if req.logprobs is not None else None
                reason = self._finish_reason(seq)  # (tool calls are a chat's)
                choices.append(oai.CompletionChoice(index=i, finish_reason=reason, text=text, logprobs=text_lps))
        answer = oai.ChatCompletion if chat else oai.Completion
        return answer(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            created=int(time.time()),
            model=req.model,
            choices=choices,
            usage=oai.Usage(**self._usage(prompt, output)),
        )

    # ---- streaming --------------------------------------------------------------------------

    async def stream(self, req: CompletionRequest | ChatCompletionRequest, tenant: str) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token as it is sampled, then finish reasons, usage, [DONE].

        Validation happens before the first chunk, so a bad request is still a plain 4xx.
        """
        chat = isinstance(req, ChatCompletionRequest)
        prompt, spec, events, task = await self.start(req.model, tenant, lambda: self._prepare(req))
        return self._sse(req, chat, prompt, spec, events, task)

    async def start(
        self, model: str, tenant: str, prepare: Prepare
    ) -> tuple[list[int], SampleSpec, asyncio.Queue, asyncio.Future]:
        """What ``complete`` does, streamed: once the request is valid (a bad one is still a plain
        4xx), the sampling runs in a task; each token comes on the queue as ``(sample, token,
        logprob)`` as the engine has it, then ``None`` when the task is done, whose result is the
        whole output. The slot is held while the engine works, whether or not the client reads."""
        weights = self.resolve(model, tenant)
        held = ExitStack()
        held.enter_context(self.slot(model, tenant))
        try:
            prompt, spec = await prepare()
            held.callback(self.sampling.reserve(tenant, spec))
        except BaseException:
            held.close()
            raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_token(sample: int, token: int, logprob: float) -> None:  # on the dispatch thread
            loop.call_soon_threadsafe(events.put_nowait, (sample, token, logprob))

        task = asyncio.ensure_future(self.sampling.run(weights, spec, on_token, self.charge(tenant)))

        def finished(_: asyncio.Future) -> None:
            held.close()
            events.put_nowait(None)

        task.add_done_callback(finished)
        return prompt, spec, events, task

    async def _sse(
        self, req, chat: bool, prompt: list[int], spec: SampleSpec, events: asyncio.Queue, task: asyncio.Future
    ) -> AsyncIterator[str]:
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created, rows = int(time.time()), [StreamedRow() for _ in range(spec.num_samples)]

        def chunk(
            index: int, text: str | None, finish: str | None, first: bool = False, calls: list | None = None
        ) -> str:
            if chat:
                delta: dict[str, Any] = ({"role": "assistant", "content": ""} if first else {}) | (
                    {"content": text} if text else {}
                )
                delta |= {"tool_calls": calls} if calls else {}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                body = {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": req.model,
                    "choices": [choice],
                }
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
                body = {
                    "id": ident,
                    "object": "text_completion",
                    "created": created,
                    "model": req.model,
                    "choices": [choice],
                }
            return f"data: {json.dumps(body)}\n\n"

        tools = offered_tools(req) if chat else None
        shown, keep = self.streamed_spec(spec, tools)
        if chat:
            for i in range(len(rows)):
                yield chunk(i, None, None, first=True)
        while (event := await events.get()) is not None:
            s, token, _ = event
            if text := self.delta(rows[s], token, shown, keep):
                yield chunk(s, text, None)
        try:
            output: SampleOutput = task.result()
        except ApiError as e:
            yield f"data: {json.dumps({'error': {'message': e.detail, 'type': 'invalid_request_error'}})}\n\n"
            return
        except Exception as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            return
        for i, (row, seq) in enumerate(zip(rows, output.sequences, strict=True)):
            text, _, calls = await self.on_tokenizer_thread(self.read_answer, seq.tokens, spec, tools)
            if calls:  # each call whole, in one chunk, as OpenAI's deltas may carry it
                entries = [call | {"index": j} for j, call in enumerate(tool_call_entries(calls))]
                yield chunk(i, text[len(row.sent) :] or None, None, calls=entries)
            yield chunk(
                i, None if calls else text[len(row.sent) :] or None, "tool_calls" if calls else self._finish_reason(seq)
            )
        options = req.stream_options
        if options is not None and options.include_usage:
            body = {
                "id": ident,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": self._usage(prompt, output),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
