"""Sampling: validate a request into a ``SampleSpec`` and hand it to the inference engine.

The engine is the embedded one (batched on the backend worker) or vLLM. With vLLM, requests
that need prompt logprobs still go to the embedded engine: the training backend computes
them exactly, and vLLM 0.32 cannot (see ``vllm_engine.needs_embedded``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core.checkpoints import CheckpointError, CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import EngineUnavailable, WireError, bad_request, not_found, unavailable
from hosted_tinker.core.images import MAX_REQUEST_PIXELS, ImageInput
from hosted_tinker.core.sampling import SampleOutput, SampleSpec
from hosted_tinker.inference.embedded import EmbeddedEngine
from hosted_tinker.inference.engine import SampleListener, WeightsRef
from hosted_tinker.inference.vllm_engine import VllmEngine, needs_embedded
from hosted_tinker.server.persistence.records import SamplerRecord
from hosted_tinker.server.persistence.sequences import Sampled, SequenceRecords
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.proto_codec import decode_tensor_json, encode_sample_response
from hosted_tinker.server.scheduler import Scheduler
from hosted_tinker.server.serving.images import ImageLayout
from hosted_tinker.server.serving.sample_budget import SampleBudget
from hosted_tinker.server.serving.usage import Charge, UsageLedger

DEFAULT_MAX_TOKENS = 256
MAX_NUM_SAMPLES = 128
MAX_TOPK = 64
# Each stop string is looked for after every sampled token of every row (in the decoded tail as
# long as the longest): what the list may cost is bounded. OpenAI takes 4 stop sequences.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128

log = logging.getLogger(__name__)
WARN_EVERY_S = 60.0


def check_num_samples(num_samples: int) -> None:
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise bad_request(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {num_samples}")


def prompt_tokens(
    prompt: wire.ModelInput, context: int, images: ImageLayout
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's token ids, and its images (``images`` lays them in, or refuses them for a
    text-only model). Chunks arrive loosely typed, so each is validated now and its errors are
    reported against it; a text chunk longer than the ``context`` before its numbers are."""
    tokens: list[int] = []
    laid: list[ImageInput] = []
    budget = [MAX_REQUEST_PIXELS]
    for i, chunk in enumerate(prompt.chunks):
        where = f"prompt.chunks[{i}]"
        kind = chunk.get("type", "encoded_text")
        if kind == "image":
            image = images.prompt_image(chunk, len(tokens), where, budget)
            laid.append(image)
            tokens += [images.image_tokens(where).image_token_id] * image.tokens  # (prompt_image checked it)
            if len(tokens) >= context:
                raise bad_request(f"prompt has {len(tokens)} tokens or more; the context holds {context} in all")
            continue
        if kind != "encoded_text":
            raise bad_request(f"{where}: {kind} chunks are not supported (text and images)")
        if isinstance(raw := chunk.get("tokens"), list) and len(tokens) + len(raw) >= context:
            raise bad_request(f"prompt has {len(tokens) + len(raw)} tokens or more; the context holds {context} in all")
        try:
            tokens += wire.EncodedTextChunk.model_validate(chunk).tokens
        except ValidationError as e:
            first = e.errors()[0]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
            raise bad_request(f"{where}{loc}: {first['msg']}") from None
    return tokens, tuple(laid)


@dataclass(frozen=True)
class Recording:
    """Where a request sampled with ``record_stability_info`` is recorded: its session, its key
    (``<sampler>:<seq_id>``) and the ids its sequences were given."""

    session_id: str
    request_key: str
    sequence_ids: list[str]
    owner: str  # the key that sampled: its ``record_bytes`` bound the routing kept


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
        embedded: EmbeddedEngine,
        sequences: SequenceRecords,
        vllm: VllmEngine | None = None,
        *,
        served_names: Sequence[str] = (),
        usage: UsageLedger | None = None,
        images: ImageLayout | None = None,
        budget: SampleBudget | None = None,
        record_limit: Callable[[str], int | None] = lambda key: None,
    ) -> None:
        self.images = images or ImageLayout(backend.capabilities, None)  # lays a prompt's images in
        # the routing a key's live sampling records may hold (its ``record_bytes`` limit; None: any)
        self.record_limit = record_limit
        self._routing_dropped: dict[str, float] = {}  # key -> when it was last said that its routing was not kept
        self.usage = usage  # what each key sampled (``serving.usage``)
        self.budget = budget  # what a request and a key may ask of the embedded engine (None: no bound)
        self.backend = backend
        self.scheduler = scheduler
        self.store = store
        self.files = files
        self.ephemeral = ephemeral
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.embedded = embedded
        self.sequences = sequences  # stability info, for samplers that record it
        self.vllm = vllm
        self.served_names = served_names  # what a sampling session on the base model may name
        self._running: dict[str, asyncio.Task] = {}  # request id -> its sampling, until it ends
        self._cancelled: set[str] = set()
        self._finishing: set[str] = set()  # results being stored: too late to cancel

    # ---- validation -------------------------------------------------------------------------

    def weights_of(self, sampler: SamplerRecord) -> WeightsRef:
        if sampler.kind == "inflight":  # the model's newest inflight weights, whichever session
            sampler = next(s for s in self.store.ephemeral_samplers(model_id=sampler.model_id) if s.kind == "inflight")
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
        target_prompt_ids: np.ndarray | None = None,
        prompt_alt_tokens_k: int = 0,
        images: tuple[ImageInput, ...] = (),
        cost_field: str = "num_samples * (prompt tokens + sampling_params.max_tokens)",
        field: Callable[[str], str] = lambda name: f"sampling_params.{name}",
    ) -> SampleSpec:
        """The validated request; ``cost_field`` is how the client spells ``n * (prompt + max_tokens)``
        and ``field`` how it names a sampling parameter (each door its own: errors name what was sent)."""
        caps = self.backend.capabilities
        if not prompt:
            raise bad_request("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < caps.vocab_size]
        if bad:
            raise bad_request(f"prompt contains token id {bad[0]}, outside the vocabulary [0, {caps.vocab_size})")
        if len(prompt) >= caps.max_seq_len:  # not even one token fits after it
            raise bad_request(f"prompt has {len(prompt)} tokens; the context holds {caps.max_seq_len} in all")
        check_num_samples(num_samples)
        # The SDK documents any 64-bit seed; a larger one would fail in the engine instead of here.
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise bad_request(f"{field('seed')} must fit in 64 bits, got {params.seed}")
        room = caps.max_seq_len - len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        if not 0 <= max_tokens <= room:
            raise bad_request(
                f"{field('max_tokens')} must be between 0 and {room} (the context holds {caps.max_seq_len} "
                f"tokens, the prompt {len(prompt)}), got {max_tokens}"
            )
        if not (params.temperature >= 0 and math.isfinite(params.temperature)):
            raise bad_request(f"{field('temperature')} must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise bad_request(f"{field('top_p')} must be in (0, 1], got {params.top_p}")
        if params.top_k == 0 or params.top_k < -1:
            raise bad_request(f"{field('top_k')} must be -1 (no limit) or >= 1, got {params.top_k}")
        stop_ids = self.eos_token_ids
        stop_strings: tuple[str, ...] = ()
        if params.stop is not None:  # an explicit stop replaces EOS; [] disables stopping
            stops: list[object] = [params.stop] if isinstance(params.stop, str) else list(params.stop)
            ids = [x for x in stops if isinstance(x, int)]
            strings = [x for x in stops if isinstance(x, str)]
            if ids:
                if len(ids) < len(stops) or not all(0 <= x < caps.vocab_size for x in ids):
                    raise bad_request(f"{field('stop')} must be all strings or all token ids in the vocabulary")
                stop_ids = frozenset(ids)
            else:
                if any(s == "" for s in strings):
                    raise bad_request(f"{field('stop')} contains an empty string")
                if len(strings) > MAX_STOP_STRINGS or max(map(len, strings), default=0) > MAX_STOP_CHARS:
                    raise bad_request(
                        f"{field('stop')} takes at most {MAX_STOP_STRINGS} strings of at most "
                        f"{MAX_STOP_CHARS} characters each"
                    )
                stop_ids, stop_strings = frozenset(), tuple(strings)
        for name, k in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
            if not 0 <= k <= MAX_TOPK:
                raise bad_request(f"{name} must be between 0 and {MAX_TOPK}, got {k}")
        if not 0 <= prompt_alt_tokens_k <= MAX_TOPK:
            raise bad_request(f"prompt_alt_tokens_k must be between 0 and {MAX_TOPK}, got {prompt_alt_tokens_k}")
        if target_prompt_ids is not None:
            self._check_target_ids(target_prompt_ids, len(prompt))
        if prompt_logprobs_last_n is not None:
            if not (prompt_logprobs or topk_prompt_logprobs):
                raise bad_request("prompt_logprobs_last_n needs prompt_logprobs or topk_prompt_logprobs")
            if not 1 <= prompt_logprobs_last_n <= len(prompt) - 1:
                raise bad_request(f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1}")
        spec = SampleSpec(
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
            target_prompt_ids=torch.from_numpy(target_prompt_ids) if target_prompt_ids is not None else None,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            images=images,
        )
        self._check_engine(spec)  # every request passes here before anything is queued
        if self.budget is not None and not self.uses_vllm(spec):  # vLLM does not run on the training worker
            self.budget.check(spec, cost_field)
        return spec

    def reserve(self, owner: str | None, spec: SampleSpec) -> Callable[[], None]:
        """Count ``spec`` against its key's ``sample_tokens`` until the returned function is called
        (a 429 naming the limit when it would pass it)."""
        if self.budget is None or self.uses_vllm(spec):
            return lambda: None
        return self.budget.reserve(owner, spec)

    def _check_engine(self, spec: SampleSpec) -> None:
        """Refuse at once what no engine here serves: the embedded sampler runs only where the
        training plan keeps a model tree it can share (``capabilities.sampling``)."""
        caps = self.backend.capabilities
        if self.uses_vllm(spec) or caps.sampling:
            return
        if self.vllm is not None:
            raise bad_request(
                "prompt scoring (prompt logprobs, target_prompt_logprobs, prompt_alt_tokens_k) and max_tokens 0 "
                f"need the embedded sampler, which the {caps.backend!r} "
                "backend does not run (vLLM serves every other request)"
            )
        raise bad_request(
            f"this server has no sampler: the {caps.backend!r} backend does not run the embedded one; "
            "start the server with --inference vllm to sample"
        )

    def _check_target_ids(self, ids: np.ndarray, prompt_len: int) -> None:
        """``[len(prompt) - 1, K]`` ids in the vocabulary or -1, at least one, and at most
        ``MAX_TOPK`` distinct ones (the cost is prompt length × distinct ids, as for top-k)."""
        where = "target_prompt_logprobs"
        if ids.ndim != 2 or ids.shape[0] != prompt_len - 1 or ids.shape[1] < 1:
            raise bad_request(
                f"{where} has shape {list(ids.shape)}; expected [{prompt_len - 1}, K] (len(prompt) - 1 rows)"
            )
        vocab = self.backend.capabilities.vocab_size
        bad = ids[(ids < -1) | (ids >= vocab)]
        if bad.size:
            raise bad_request(f"{where} contains token id {int(bad[0])}; ids are in [0, {vocab}) or -1 for none")
        distinct = np.unique(ids[ids >= 0])
        if not distinct.size:
            raise bad_request(f"{where} names no token id (every cell is -1)")
        if distinct.size > MAX_TOPK:
            raise bad_request(f"{where} names {distinct.size} distinct token ids; at most {MAX_TOPK}")

    # ---- sampling sessions ------------------------------------------------------------------

    def create_sampling_session(self, req: wire.CreateSamplingSessionRequest) -> rsp.CreateSamplingSessionResponse:
        """Register a sampler on the base model or on a saved adapter (sampling itself: issue #4)."""
        status = self.store.session_status(req.session_id)
        if status is None:
            raise not_found(f"session_id {req.session_id!r} does not exist")
        if (req.base_model is None) == (req.model_path is None):
            raise bad_request("create_sampling_session needs exactly one of base_model and model_path")
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        existing = self.store.get_sampler(sampler_id)
        if existing is not None:
            if (existing.base_model if req.base_model else existing.model_path) in (req.base_model, req.model_path):
                return rsp.CreateSamplingSessionResponse(sampling_session_id=sampler_id)  # a resend
            raise bad_request(f"sampling_session_seq_id {req.sampling_session_seq_id} is already used")
        if req.base_model is not None:
            if req.base_model not in self.served_names:
                raise bad_request(f"base_model {req.base_model!r} is not served; served: {self.served_names}")
            base_model = req.base_model
        elif req.model_path is not None:  # (exactly one of the two, checked above)
            try:
                path = TinkerPath.parse(req.model_path, "model_path")
            except CheckpointError as e:
                raise bad_request(str(e)) from None
            model = self.store.get_model(path.run_id)
            if model is None or self.store.get_checkpoint(path.run_id, path.kind, path.name) is None:
                raise not_found(f"model_path: checkpoint {req.model_path} does not exist")
            if self.files.encrypted(path):
                raise bad_request(f"model_path {path} is encrypted to its recipients: it cannot be sampled here")
            if model.base_model not in self.served_names:  # a data directory another model trained in
                raise bad_request(
                    f"model_path: {req.model_path} was trained on {model.base_model!r}; served: {self.served_names}"
                )
            base_model = model.base_model
        self.store.add_sampler(
            sampler_id, session_id=req.session_id, base_model=base_model, model_path=req.model_path, model_id=None
        )
        return rsp.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    def get_sampler(self, sampler_id: str) -> rsp.GetSamplerResponse:
        sampler = self.store.get_sampler(sampler_id)
        if sampler is None:
            raise not_found(f"sampler {sampler_id!r} does not exist")
        return rsp.GetSamplerResponse(
            sampler_id=sampler.sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
        )

    # ---- the Tinker endpoint ----------------------------------------------------------------

    def asample(self, req: wire.SampleRequest) -> tuple[str, list[str]]:
        check_num_samples(req.num_samples)  # first: it sizes the list of sequence ids below
        if req.sampling_session_id is None:
            raise bad_request("asample needs sampling_session_id (create a sampling client first)")
        sampler = self.store.get_sampler(req.sampling_session_id)
        if sampler is None:
            raise not_found(f"sampling_session_id {req.sampling_session_id!r} does not exist")
        seq_id = req.seq_id if req.seq_id is not None else secrets.randbits(62)
        request_key = f"{sampler.sampler_id}:{seq_id}"
        sequence_ids = [f"{request_key}:{i}" for i in range(req.num_samples)]
        if (existing := self.scheduler.find(sampler.sampler_id, seq_id)) is not None:  # a resend
            return existing, sequence_ids
        prompt, images = prompt_tokens(req.prompt, self.backend.capabilities.max_seq_len, self.images)
        target_ids, target_layout = None, None
        if req.target_prompt_logprobs is not None and prompt:  # an empty prompt: spec() says so
            if req.target_prompt_logprobs.dtype != "int64":
                raise bad_request("target_prompt_logprobs must be an int64 tensor of token ids")
            try:
                target_ids, target_layout = decode_tensor_json(
                    req.target_prompt_logprobs, "target_prompt_logprobs", len(prompt) - 1, pad=-1
                )
            except WireError as e:
                raise bad_request(str(e)) from None
        spec = self.spec(
            prompt,
            req.sampling_params,
            num_samples=req.num_samples,
            prompt_logprobs=req.prompt_logprobs,
            topk_prompt_logprobs=req.topk_prompt_logprobs,
            prompt_logprobs_last_n=req.prompt_logprobs_last_n,
            topk_sample_logprobs=req.topk_sample_logprobs,
            target_prompt_ids=target_ids,
            prompt_alt_tokens_k=req.prompt_alt_tokens_k,
            images=images,
        )
        if req.record_stability_info:  # and, on a mixture-of-experts model, each token's experts (routing replay)
            spec = dataclasses.replace(spec, record_routing=True)
        if self.uses_vllm(spec):
            self._check_vllm_ready()  # a 503 the SDK retries, rather than a failed future
        self.scheduler.check_capacity(sampler.sampler_id, None)
        charge = self._charge(sampler)
        release = self.reserve(charge.owner, spec)
        try:
            request_id = self.scheduler.register("sample", model_id=sampler.sampler_id, seq_id=seq_id)
        except BaseException:
            release()
            raise
        # With record_stability_info, what the sampler chose is recorded for training
        # (``server.persistence.sequences``) under the ids the client gets, before the result is visible.
        record = (
            Recording(sampler.session_id, request_key, sequence_ids, charge.owner)
            if req.record_stability_info
            else None
        )
        task = asyncio.get_running_loop().create_task(
            self._sample_into(request_id, self.weights_of(sampler), spec, record, target_layout, charge)
        )
        self._running[request_id] = task

        def ended(_: asyncio.Task) -> None:
            self._running.pop(request_id, None)
            release()

        task.add_done_callback(ended)
        return request_id, sequence_ids

    def cancel(self, request_id: str) -> bool:
        """Stop a sampling request its client gave up (``cancel_future``): its future fails with
        ``category: user``, and the engine drops its rows (vLLM: the request is aborted). False
        if it had already finished."""
        task = self._running.get(request_id)
        if task is None or task.done() or request_id in self._finishing:
            return False
        self._cancelled.add(request_id)
        task.cancel()
        return True

    def _charge(self, sampler: SamplerRecord) -> Charge:
        return Charge(self.store.session_owner(sampler.session_id) or "", sampler.session_id, sampler.base_model)

    async def _sample_into(
        self,
        request_id: str,
        weights: WeightsRef,
        spec: SampleSpec,
        record: Recording | None,
        target_layout: pb.Tensor | None = None,
        charge: Charge | None = None,
    ) -> None:
        try:
            output = await self.run(weights, spec, charge=charge)
            if record is not None:
                sequences = [
                    Sampled(sid, s.tokens, s.logprobs, s.routing)
                    for sid, s in zip(record.sequence_ids, output.sequences, strict=True)
                ]
                kept = await asyncio.to_thread(
                    functools.partial(
                        self.sequences.record,
                        owner=record.owner,
                        routing_limit=self.record_limit(record.owner),
                    ),
                    record.session_id,
                    record.request_key,
                    spec.prompt,
                    sequences,
                    output.prompt_routing,
                )
                if (
                    not kept
                    and time.monotonic() - self._routing_dropped.get(record.owner, -WARN_EVERY_S) > WARN_EVERY_S
                ):
                    self._routing_dropped[record.owner] = time.monotonic()  # a line a minute per key, at most
                    log.warning(
                        "key %s holds its record_bytes limit of routing in live sampling records: its new records "
                        "keep no routing (not replayed in training) until older ones expire",
                        record.owner,
                    )
        except Exception as e:
            self.scheduler.fail_with(request_id, e)
        except asyncio.CancelledError:
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                self.scheduler.cancelled += 1
                self.scheduler.fail(request_id, "cancelled by its client (cancel_future)", "user")
                return
            # The server is shutting down: the future must still end.
            self.scheduler.fail(request_id, "the server stopped while sampling; retry", "server")
            raise
        else:
            await self._complete(request_id, output, target_layout)

    async def _complete(self, request_id: str, output: SampleOutput, target_layout: pb.Tensor | None) -> None:
        """Encode and store a result on a thread: one of many samples' top-k rows (tens of MB)
        would hold up the event loop, and every other request with it. A cancel that comes
        meanwhile finds the result on its way (shielded): the future ends either way."""

        def finish() -> None:
            try:
                payload = encode_sample_response(output, target_layout)
                self.scheduler.complete(request_id, payload, "application/x-protobuf")
            except Exception as e:  # e.g. the database stayed locked: the future must still end
                self.scheduler.fail_with(request_id, e)

        self._finishing.add(request_id)  # too late to cancel (``cancel`` says so): it is being stored
        try:
            await asyncio.shield(asyncio.to_thread(finish))
        finally:
            self._finishing.discard(request_id)

    def uses_vllm(self, spec: SampleSpec) -> bool:
        return self.vllm is not None and not needs_embedded(spec)

    def _vllm(self) -> VllmEngine:
        """The vLLM engine, for a request ``uses_vllm`` sends there (never without one)."""
        if self.vllm is None:
            raise RuntimeError("no vLLM engine")
        return self.vllm

    def _check_vllm_ready(self) -> None:
        try:
            self._vllm().check_ready()
        except EngineUnavailable as e:
            raise unavailable(str(e), e.retry_after) from None

    async def run(
        self,
        weights: WeightsRef,
        spec: SampleSpec,
        on_token: SampleListener | None = None,
        charge: Charge | None = None,
    ) -> SampleOutput:
        """Sample on the engine that serves ``spec`` (for the Tinker and the OpenAI routes); what it
        used counts against ``charge``."""
        if self.uses_vllm(spec):
            output = await self._vllm().sample(weights, spec, on_token)
        else:
            owner = charge.owner if charge is not None else None  # each key's requests take turns with the others'
            output = await self.embedded.sample(weights, spec, on_token, owner=owner)
        sampled = sum(len(s.tokens) for s in output.sequences)
        self.scheduler.metrics.tokens_sampled.inc(sampled)
        if self.usage is not None and charge is not None:
            self.usage.sampled(charge, len(spec.prompt), sampled)
        return output
