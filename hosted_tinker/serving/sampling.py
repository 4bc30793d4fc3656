"""Sampling: validate a request into a ``SampleSpec``, then batch it with whatever else is
waiting and run the batch on the backend worker.

Requests that arrive while the worker is busy (training another model, or a previous batch)
accumulate and go out as one batch, so concurrent requests share forward passes, and a
training request waits for at most one sampling batch.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from safetensors.torch import load as load_safetensors

from hosted_tinker.backends.base import UserError
from hosted_tinker.checkpoints import CheckpointFiles, TinkerPath
from hosted_tinker.inference.generate import SampleOutput, SampleSpec
from hosted_tinker.protocol import json_types as wire
from hosted_tinker.protocol.proto_codec import encode_sample_response
from hosted_tinker.scheduler import Scheduler
from hosted_tinker.serving.errors import bad_request, not_found
from hosted_tinker.store import SamplerRecord, Store

DEFAULT_MAX_TOKENS = 256
MAX_NUM_SAMPLES = 128
MAX_TOPK = 64
MAX_BATCH_ROWS = 64  # sequences decoded together in one batch


@dataclass
class WeightsRef:
    """Which weights a sampler uses: the base model (``key`` None) or a saved adapter."""

    key: str | None
    files: CheckpointFiles | None = None
    path: TinkerPath | None = None


@dataclass
class _Pending:
    request_id: str
    weights: WeightsRef
    spec: SampleSpec
    on_done: Callable[[object], None] | None = None  # for in-process callers (OpenAI routes)


class SamplingService:
    def __init__(
        self,
        backend,
        scheduler: Scheduler,
        store: Store,
        files: CheckpointFiles,
        ephemeral: CheckpointFiles,
        tokenizer,
        eos_token_ids: set[int],
        batch_window_s: float = 0.01,
    ) -> None:
        self.backend = backend
        # A request that finds the engine idle waits this long for company: clients send a
        # group's requests at once, and one batch of 16 costs about what a batch of 1 does.
        self.batch_window_s = batch_window_s
        self.scheduler = scheduler
        self.store = store
        self.files = files
        self.ephemeral = ephemeral
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._scheduled = False

    # ---- validation -------------------------------------------------------------------------

    def weights_of(self, sampler: SamplerRecord) -> WeightsRef:
        if sampler.snapshot is not None:
            return WeightsRef(sampler.snapshot, self.ephemeral, TinkerPath.parse(sampler.snapshot))
        if sampler.model_path is not None:
            return WeightsRef(sampler.model_path, self.files, TinkerPath.parse(sampler.model_path))
        return WeightsRef(None)

    def spec(
        self,
        prompt: list[int],
        params: wire.SamplingParams,
        *,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
        topk_sample_logprobs: int = 0,
    ) -> SampleSpec:
        caps = self.backend.capabilities
        if not prompt:
            raise bad_request("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < caps.vocab_size]
        if bad:
            raise bad_request(f"prompt contains token id {bad[0]}, outside the vocabulary [0, {caps.vocab_size})")
        if not 1 <= num_samples <= MAX_NUM_SAMPLES:
            raise bad_request(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {num_samples}")
        room = caps.max_seq_len - len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        if not 0 <= max_tokens <= room:
            raise bad_request(
                f"sampling_params.max_tokens must be between 0 and {room} (the context holds {caps.max_seq_len} "
                f"tokens, the prompt {len(prompt)}), got {max_tokens}"
            )
        if not (params.temperature >= 0 and math.isfinite(params.temperature)):
            raise bad_request(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise bad_request(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        if params.top_k == 0 or params.top_k < -1:
            raise bad_request(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {params.top_k}")
        stop_ids, stop_strings = self.eos_token_ids, ()
        if params.stop is not None:  # an explicit stop replaces EOS; [] disables stopping
            stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
            if any(isinstance(x, int) for x in stops):
                if not all(isinstance(x, int) and 0 <= x < caps.vocab_size for x in stops):
                    raise bad_request("sampling_params.stop must be all strings or all token ids in the vocabulary")
                stop_ids = frozenset(stops)
            else:
                if any(s == "" for s in stops):
                    raise bad_request("sampling_params.stop contains an empty string")
                stop_ids, stop_strings = frozenset(), tuple(stops)
        for name, k in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
            if not 0 <= k <= MAX_TOPK:
                raise bad_request(f"{name} must be between 0 and {MAX_TOPK}, got {k}")
        if prompt_logprobs_last_n is not None:
            if not (prompt_logprobs or topk_prompt_logprobs):
                raise bad_request("prompt_logprobs_last_n needs prompt_logprobs or topk_prompt_logprobs")
            if not 1 <= prompt_logprobs_last_n <= len(prompt) - 1:
                raise bad_request(f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1}")
        return SampleSpec(
            prompt=prompt,
            max_tokens=max_tokens,
            num_samples=num_samples,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop_token_ids=stop_ids,
            stop_strings=stop_strings,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            topk_sample_logprobs=topk_sample_logprobs,
        )

    def _refuse_unsupported(self, req: wire.SampleRequest) -> None:
        unsupported = {
            "target_prompt_logprobs": req.target_prompt_logprobs is not None,
            "prompt_alt_tokens_k": req.prompt_alt_tokens_k != 0,
            "record_stability_info": req.record_stability_info,
        }
        for name, used in unsupported.items():
            if used:
                raise bad_request(f"{name} is not supported by this server's sampler")

    # ---- the Tinker endpoint ----------------------------------------------------------------

    def asample(self, req: wire.SampleRequest) -> tuple[str, list[str]]:
        if req.sampling_session_id is None:
            raise bad_request("asample needs sampling_session_id (create a sampling client first)")
        sampler = self.store.get_sampler(req.sampling_session_id)
        if sampler is None:
            raise not_found(f"sampling_session_id {req.sampling_session_id!r} does not exist")
        seq_id = req.seq_id if req.seq_id is not None else secrets.randbits(62)
        sequence_ids = [f"{sampler.sampler_id}:{seq_id}:{i}" for i in range(req.num_samples)]
        if (existing := self.scheduler.find(sampler.sampler_id, seq_id)) is not None:  # a resend
            return existing, sequence_ids
        self._refuse_unsupported(req)
        tokens: list[int] = []
        for i, chunk in enumerate(req.prompt.chunks):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise bad_request(f"prompt.chunks[{i}]: {chunk.get('type')} chunks are not supported (text only)")
            tokens += wire.EncodedTextChunk.model_validate(chunk).tokens
        spec = self.spec(
            tokens,
            req.sampling_params,
            num_samples=req.num_samples,
            prompt_logprobs=req.prompt_logprobs,
            topk_prompt_logprobs=req.topk_prompt_logprobs,
            prompt_logprobs_last_n=req.prompt_logprobs_last_n,
            topk_sample_logprobs=req.topk_sample_logprobs,
        )
        request_id = self.scheduler.register("sample", model_id=sampler.sampler_id, seq_id=seq_id)
        self.enqueue(_Pending(request_id, self.weights_of(sampler), spec))
        return request_id, sequence_ids

    async def run(self, weights: WeightsRef, spec: SampleSpec) -> SampleOutput:
        """Sample in-process (for the OpenAI routes): batched with everything else, awaited here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_done(result: object) -> None:
            loop.call_soon_threadsafe(_settle, done, result)

        self.enqueue(_Pending("", weights, spec, on_done))
        return await done

    # ---- batching ---------------------------------------------------------------------------

    def enqueue(self, item: _Pending) -> None:
        """Add a request (on the event loop); start a batch after the window if none is coming."""
        with self._lock:
            self._pending.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        if self.batch_window_s > 0:
            asyncio.get_running_loop().call_later(self.batch_window_s, self.scheduler.run_on_worker, self._run_batch)
        else:
            self.scheduler.run_on_worker(self._run_batch)

    def _take(self, key: str | None, max_rows: int) -> list[_Pending]:
        """Oldest-first waiting requests on weights ``key``, up to ``max_rows`` sequences."""
        with self._lock:
            taken, rest, rows = [], [], 0
            for item in self._pending:
                if item.weights.key == key and rows + item.spec.num_samples <= max_rows:
                    taken.append(item)
                    rows += item.spec.num_samples
                else:
                    rest.append(item)
            self._pending = rest
            return taken

    def _run_batch(self) -> None:
        """On the worker: decode the oldest request's weights group, admitting newcomers on the
        same weights between steps, up to ``MAX_BATCH_ROWS`` sequences per run (so a run ends,
        and training requests queued behind it wait for one run at most)."""
        with self._lock:
            head = self._pending[0] if self._pending else None
        if head is not None:
            self._sample_group(head.weights)
        with self._lock:
            more = bool(self._pending)
            self._scheduled = more
        if more:
            self.scheduler.run_on_worker(self._run_batch)

    def _sample_group(self, weights: WeightsRef) -> None:
        items = self._take(weights.key, MAX_BATCH_ROWS)
        budget = MAX_BATCH_ROWS - sum(i.spec.num_samples for i in items)

        def admit() -> list[SampleSpec]:
            nonlocal budget
            if budget <= 0:
                return []
            arrivals = self._take(weights.key, budget)
            budget -= sum(i.spec.num_samples for i in arrivals)
            items.extend(arrivals)
            return [i.spec for i in arrivals]

        try:
            self._ensure_loaded(weights)
            specs = [i.spec for i in items]
            outputs = self.backend.generate(weights.key, specs, self._decode, lambda: secrets.randbits(62), admit)
        except UserError as e:
            self._fail(items, str(e), "user")
            return
        except Exception as e:
            self._fail(items, f"internal error while sampling: {type(e).__name__}: {e}", "server")
            return
        for item, output in zip(items, outputs, strict=True):
            if item.on_done is not None:
                item.on_done(output)
            else:
                self.scheduler.complete(item.request_id, encode_sample_response(output), "application/x-protobuf")

    def _fail(self, items: list[_Pending], error: str, category: str) -> None:
        for item in items:
            if item.on_done is not None:
                item.on_done(UserError(error) if category == "user" else RuntimeError(error))
            else:
                self.scheduler.fail(item.request_id, error, category)

    def _ensure_loaded(self, weights: WeightsRef) -> None:
        if weights.key is None or self.backend.has_sampler(weights.key):
            return
        files = weights.files.read(weights.path, only=("adapter_config.json", "adapter_model.safetensors"))
        config = json.loads(files["adapter_config.json"])
        self.backend.load_sampler(weights.key, config, load_safetensors(files["adapter_model.safetensors"]))

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
