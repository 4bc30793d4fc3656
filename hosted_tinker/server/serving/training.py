"""Training requests: validate at submit (a clear 400 now beats a failed future later), then
queue a job that runs on the backend worker and encodes its own result."""

from __future__ import annotations

import functools
import json
import math
import secrets
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from hosted_tinker.core import losses
from hosted_tinker.core.custom_loss import reduce_metrics
from hosted_tinker.core.errors import (
    ApiError,
    UserError,
    WireError,
    bad_request,
    not_found,
)
from hosted_tinker.core.routing import replay_metrics, routing_metrics
from hosted_tinker.core.types import OPTIMIZER_CONFIGS, DatumInput, ForwardBackwardBatch, LoraSpec
from hosted_tinker.server.persistence.records import COPY_STATUS, ModelRecord
from hosted_tinker.server.persistence.sequences import RecordedSequence, SequenceRecords
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.proto_codec import (
    Span,
    WireDatum,
    WireForwardBackward,
    encode_forward_backward_output,
)
from hosted_tinker.server.quotas import Quotas
from hosted_tinker.server.scheduler import Job, Scheduler
from hosted_tinker.server.serving import optimizers, provenance
from hosted_tinker.server.serving.batch_checks import check_datum
from hosted_tinker.server.serving.custom_losses import CustomLossService
from hosted_tinker.server.serving.events import Trained, TrainingEvents
from hosted_tinker.server.serving.images import ImageLayout
from hosted_tinker.server.serving.joint_passes import Finish, JointPasses
from hosted_tinker.server.serving.residency import PARKED, Residency
from hosted_tinker.server.serving.run_metrics import OPTIM_STEP
from hosted_tinker.server.workers.backend import ProcessBackend

JSON = "application/json"
# Checks one of a model's ordered requests, given its live record, and makes its job (raises a
# refusal, which still uses up the request's seq_id: ``TrainingService.submit_ordered``).
Prepare = Callable[[ModelRecord], Job]
MAX_SEQ_ID = 2**31 - 1  # the protobuf field is int32
PROTOBUF = "application/x-protobuf"


def json_result(obj: dict) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), JSON


class TrainingService:
    def __init__(
        self,
        backend: ProcessBackend,
        scheduler: Scheduler,
        store: Store,
        served_names: list[str],
        tokenizer_id: str,
        sequences: SequenceRecords,
        custom_losses: CustomLossService,
        residency: Residency,
        joint: JointPasses,
        *,
        quotas: Quotas,
        events: TrainingEvents | None = None,
        max_lora_rank: int | None = None,
        images: ImageLayout | None = None,
    ) -> None:
        # what follows a call or a change of weights: usage, metrics, vLLM's sync (``serving.events``)
        self.events = events if events is not None else TrainingEvents()
        self.quotas = quotas  # each key's limits, checked here as a request is admitted (not in the routes)
        # images of a ModelInput laid into its tokens (None: a text-only model)
        self.images = images or ImageLayout(backend.capabilities, None)
        self.backend = backend
        self.scheduler = scheduler
        self.store = store
        self.sequences = sequences  # what samplers recorded, for provenance spans
        self.custom_losses = custom_losses  # what sessions uploaded (loss_fn "custom")
        self.served_names = served_names
        self.tokenizer_id = tokenizer_id
        self.max_lora_rank = max_lora_rank  # the inference engine's limit, if it has one
        # Which models are on the workers; a parked one comes back before its next job runs.
        self.residency = residency
        self.joint = joint  # forward_backward requests of several models in one pass

    # ---- models ---------------------------------------------------------------------------

    def live_model(self, model_id: str) -> ModelRecord:
        model = self.store.get_model(model_id)
        if model is None:
            raise not_found(f"model_id {model_id!r} does not exist")
        if model.status == PARKED:  # on disk, not on the workers: its next job brings it back
            return model
        if model.status == "unloaded":
            raise bad_request(f"model {model_id} was unloaded")
        if model.status == "lost":
            raise bad_request(
                f"model {model_id} was lost in a server restart or with its worker; recreate it (or load a saved state)"
            )
        if model.status == COPY_STATUS:
            raise bad_request(
                f"training run {model_id} holds copied or uploaded weights and cannot be trained on; "
                "create a training client from its checkpoint"
            )
        if model.status == "failed":
            raise bad_request(f"model {model_id} could not be created; its create_model future says why")
        return model

    def create_model(self, req: wire.CreateModelRequest, owner: str) -> str:
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if (existing := self.scheduler.find(model_id, 0)) is not None:  # a resend: admitted before
            return existing
        if req.base_model not in self.served_names:
            raise bad_request(f"base_model {req.base_model!r} is not served here; served names: {self.served_names}")
        if req.lora_config is None:
            raise bad_request("lora_config is required: this server trains LoRA adapters only")
        spec = self.lora_spec(req.lora_config, optimizers.family(req.optimizer_config))
        return self.create_model_with(
            model_id,
            session_id=req.session_id,
            model_seq_id=req.model_seq_id,
            base_model=req.base_model,
            lora=spec,
            user_metadata=req.user_metadata or {},
            result={"model_id": model_id, "type": "create_model"},
            owner=owner,
        )

    def lora_spec(self, lc: wire.LoraConfig, optimizer: str = "adamw", field: str = "lora_config") -> LoraSpec:
        """The adapter ``lc`` asks for, if this server can make it (a 400 naming ``field`` else)."""
        if not (lc.train_attn or lc.train_mlp or lc.train_unembed):
            raise bad_request(f"{field}: at least one of train_attn, train_mlp, train_unembed must be true")
        caps = self.backend.capabilities
        for group in ("attn", "mlp", "unembed"):
            if getattr(lc, f"train_{group}") and group not in caps.lora_groups:
                raise bad_request(f"{field}.train_{group}: {caps.arch} has no {group} layer that LoRA can train")
        self._check_rank(lc.rank, field)
        # An unseeded adapter still gets a recorded seed, so its initialisation is reproducible.
        seed = lc.seed if lc.seed is not None else secrets.randbits(63)
        return LoraSpec(lc.rank, seed, lc.train_mlp, lc.train_attn, lc.train_unembed, optimizer)

    def _check_rank(self, rank: int, field: str = "lora_config") -> None:
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise bad_request(
                f"{field}.rank {rank} is above the inference engine's limit of {self.max_lora_rank} "
                "(start the server with a larger --max-lora-rank)"
            )

    def create_model_with(
        self,
        model_id: str,
        *,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec,
        user_metadata: dict,
        result: dict,
        owner: str,
        after_create: Callable[[str], None] | None = None,
    ) -> str:
        """Register a model and queue its creation as its request 0 (``after_create`` may load
        state). ``owner``'s limits are checked against its LoRA first: a resend never gets here
        (its caller found the original), so a model admitted once is not refused when asked again."""
        self.quotas.new_model(owner, lora, user_metadata)
        self._check_rank(lora.rank)
        status = self.store.session_status(session_id)
        if status is None:
            raise not_found(f"session_id {session_id!r} does not exist")
        if status != "active":
            raise bad_request(f"session {session_id} has finished; start a new ServiceClient")
        self.scheduler.check_capacity(model_id, 0)
        self.store.add_model(
            model_id,
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model=base_model,
            lora=lora.__dict__,
            user_metadata=user_metadata,
        )

        def job() -> tuple[bytes, str]:
            try:
                self.residency.admit(model_id)
                self.backend.trainer.create_adapter(model_id, lora)
                if after_create is not None:
                    after_create(model_id)
                self.events.weights_changed(model_id)
            except BaseException:
                self.store.set_model_status(model_id, "failed")
                self.residency.forget(model_id)
                if self.backend.trainer.has_adapter(model_id):
                    self.backend.trainer.delete_adapter(model_id)
                raise
            return json_result(result)

        request_id = self.scheduler.submit("create_model", job, model_id=model_id, seq_id=0)
        self.scheduler.open_model(model_id)
        return request_id

    def get_info(self, req: wire.GetInfoRequest) -> rsp.GetInfoResponse:
        model = self.live_model(req.model_id)
        return rsp.GetInfoResponse(
            type="get_info",
            model_data=rsp.ModelData(
                arch=self.backend.capabilities.arch, model_name=model.base_model, tokenizer_id=self.tokenizer_id
            ),
            model_id=model.model_id,
            optimizer_config=OPTIMIZER_CONFIGS[model_optimizer(model)],
            is_lora=True,
            lora_rank=model.lora["rank"],
            model_name=model.base_model,
        )

    def unload_model(self, model_id: str) -> str:
        """Free the model's adapter; requests still waiting for their turn fail."""
        self.live_model(model_id)
        self.store.set_model_status(model_id, "unloaded")
        self.scheduler.close_model(model_id)
        self.events.gone(model_id)

        def job() -> tuple[bytes, str]:
            if self.backend.trainer.has_adapter(model_id):  # else parked: only its saved state is left
                self.backend.trainer.delete_adapter(model_id)
            self.residency.forget(model_id)
            return json_result({"model_id": model_id, "type": "unload_model"})

        return self.scheduler.submit("unload_model", job, model_id=model_id)

    def unload_session(self, session_id: str) -> int:
        """Unload every live model of a finished session; return how many."""
        model_ids = self.store.live_models_of_session(session_id)
        for model_id in model_ids:
            self.unload_model(model_id)
        return len(model_ids)

    # ---- forward / backward ---------------------------------------------------------------

    def submit_ordered(self, kind: str, model_id: str, seq_id: int, prepare: Prepare, size: int = 0) -> str:
        """Validate (``prepare``, given the model's record as read here, once per request) and
        queue one of a model's requests.

        A rejected request still consumes its ``seq_id``, as a failed future: the SDK has
        already numbered the requests after it, and they must not wait for it forever. This is
        the one place that rule is kept: every refusal of an ordered request (the key's limits
        included) is raised in its ``prepare``.
        """
        if not 1 <= seq_id <= MAX_SEQ_ID:
            raise bad_request(f"seq_id must be between 1 and {MAX_SEQ_ID}, got {seq_id}")
        if (existing := self.scheduler.find(model_id, seq_id)) is not None:  # a resend
            return existing
        model = self.live_model(model_id)
        self.scheduler.check_capacity(model_id, seq_id, size=size)
        try:
            job = prepare(model)
        except ApiError as e:
            self.scheduler.submit(kind, _failing(e.detail), model_id=model_id, seq_id=seq_id)
            raise
        job = self.residency.around(model_id, job)
        return self.scheduler.submit(kind, job, model_id=model_id, seq_id=seq_id, size=size)

    def refuse_ordered(self, kind: str, model_id: str, seq_id: int, error: ApiError) -> str:
        """Refuse one of a model's requests that failed before its ``prepare`` (a body that did not
        validate, an option we lack) as its ``seq_id``, which it still consumes: raises ``error``,
        or ``submit_ordered``'s own refusal; a resend gets the original future."""

        def prepare(_: ModelRecord) -> Job:
            raise error

        return self.submit_ordered(kind, model_id, seq_id, prepare)

    def forward_backward(self, req: WireForwardBackward, size: int = 0) -> str:
        """``size``: the request's bytes (as sent, inflated), what its batch holds until it runs."""
        # The job keeps only these and the checked batch, not the request's decoded wire form.
        model_id, seq_id, forward_only = req.model_id, req.seq_id, req.forward_only

        def prepare(model: ModelRecord) -> Job:
            batch, finish = self._validate_batch(req, model)
            entry = self.joint.register(model_id, seq_id, batch, finish)

            def job() -> tuple[bytes, str]:
                # Whichever pass ran it (its own, or earlier in another model's joint pass), a
                # request's result reaches the client here, in its turn: recorded once, in order.
                result = self.joint.run(entry)
                duration_s = entry.seconds  # its share of the pass it ran in
                tokens = sum(d.num_tokens for d in batch.data)
                outputs = [
                    {"logprobs": lp} if terms is None else {"logprobs": lp, "elementwise_loss": terms}
                    for lp, terms in zip(result.logprobs, result.elementwise_loss, strict=True)
                ]
                metrics = {
                    "loss:sum": result.loss_sum,
                    **losses.sampler_gap(batch.data, result.logprobs),
                    **reduce_metrics(result.metrics, len(batch.data)),
                    **(routing_metrics(result.routed.counts) if result.routed is not None else {}),
                    **(replay_metrics(result.routed) if result.routed is not None and batch.recorded else {}),
                }
                encoded = encode_forward_backward_output(outputs, metrics)
                self.events.trained(Trained(model_id, seq_id, kind, duration_s, tokens, metrics))
                return encoded, PROTOBUF

            return job

        kind = "forward" if forward_only else "forward_backward"
        return self.submit_ordered(kind, model_id, seq_id, prepare, size)

    def _validate_batch(self, req: WireForwardBackward, model: ModelRecord) -> tuple[ForwardBackwardBatch, Finish]:
        """The checked batch, and what is left of its preparation for where it runs (``Finish``)."""
        caps = self.backend.capabilities
        if req.loss_fn == "custom":
            return self._validate_custom_batch(req, model)
        spec = losses.LOSSES.get(req.loss_fn)
        if spec is None or req.loss_fn not in caps.losses:
            supported = sorted([*caps.losses, "custom"])
            raise bad_request(f"loss_fn {req.loss_fn!r} is not supported; supported: {supported}")
        config = dict(spec.config_defaults)
        for key, value in req.loss_fn_config.items():
            if key not in spec.config_defaults:
                raise bad_request(
                    f"loss_fn_config.{key} is not a setting of {req.loss_fn!r}; "
                    f"accepted: {sorted(spec.config_defaults) or 'none'}"
                )
            if not isinstance(value, float) or not math.isfinite(value):
                raise bad_request(f"loss_fn_config.{key} must be a finite number, got {value!r}")
            config[key] = value
        wire_data = self._wire_data(req)
        data = [check_datum(d, i, self.backend.capabilities, spec) for i, d in enumerate(wire_data)]
        recorded, finish = self._resolve_provenance(model, wire_data, data, spec)
        batch = ForwardBackwardBatch(
            data=data, loss_fn=req.loss_fn, loss_config=config, forward_only=req.forward_only, recorded=recorded
        )
        return batch, finish

    def _validate_custom_batch(
        self, req: WireForwardBackward, model: ModelRecord
    ) -> tuple[ForwardBackwardBatch, Finish]:
        """``loss_fn="custom"``: the session's stored loss (``serving.custom_losses``) by id."""
        if set(req.loss_fn_config) != {"loss_id"}:
            raise bad_request(
                "loss_fn 'custom' takes loss_fn_config {'loss_id': …}, the id create_custom_loss returned; "
                f"got keys {sorted(req.loss_fn_config)}"
            )
        loss = self.custom_losses.get(model.session_id, req.loss_fn_config["loss_id"])
        wire_data = self._wire_data(req)
        data = [check_datum(d, i, self.backend.capabilities, None, loss) for i, d in enumerate(wire_data)]
        recorded, finish = self._resolve_provenance(model, wire_data, data, None)
        return ForwardBackwardBatch(data, "custom", {}, req.forward_only, custom_loss=loss, recorded=recorded), finish

    def _wire_data(self, req: WireForwardBackward) -> list[WireDatum]:
        try:
            wire_data = req.datums()
        except WireError as e:
            raise bad_request(str(e)) from None
        if not wire_data:
            raise bad_request("data is empty: forward_backward needs at least one datum")
        self.images.data(wire_data)  # before counting: an image is as many tokens as its model makes of it
        total = sum(len(d.tokens) for d in wire_data)
        limit = self.backend.capabilities.max_tokens_per_batch
        if total > limit:
            raise bad_request(f"data holds {total} tokens, over the limit of {limit} per request")
        return wire_data

    def _resolve_provenance(
        self, model: ModelRecord, wire_data: list[WireDatum], data: list[DatumInput], spec: losses.LossSpec | None
    ) -> tuple[bool, Finish]:
        """Check every datum's provenance spans against the sampler's records (restarting their
        day), and give a loss that reads the record (``recorded_inputs``) its inputs. Only such a
        loss needs every named sequence to have a record (a custom loss, ``spec`` None, does not).
        Whether any named sequence has one; and, where some hold routing, what gives each datum
        its recorded routing to replay (``_replay``)."""
        needs_records = spec is not None and spec.needs_provenance
        for i, d in enumerate(wire_data):
            if d.model_input_spans:
                provenance.check_tiling(d, f"data[{i}]")
            elif needs_records:
                raise bad_request(
                    f"data[{i}] has no provenance: this loss reads what the sampler recorded, so every datum "
                    "must name its sampled sequences (Datum.with_provenance, after sampling with "
                    "record_stability_info=True)"
                )
        wanted = set().union(*(provenance.sequence_ids(d) for d in wire_data))
        if not wanted:
            return False, None
        records = self.sequences.take(model.session_id, wanted)
        routed: list[ToReplay] = []
        for i, (d, datum) in enumerate(zip(wire_data, data, strict=True)):
            where = f"data[{i}]"
            if not d.model_input_spans:
                continue
            resolved = provenance.resolve(d, where, records, require_records=needs_records)
            if resolved.routed:
                routed.append(ToReplay(datum, len(d.tokens), resolved.routed, where))
            if needs_records:
                if "logprobs" in datum.inputs:
                    provenance.check_client_logprobs(datum.inputs["logprobs"].numpy(), resolved, where)
                recorded = resolved.inputs()
                wanted_inputs = spec.recorded_inputs if spec is not None else ()  # needs_records: never None
                datum.inputs.update({key: torch.from_numpy(recorded[key]) for key in wanted_inputs})
        return bool(records), (functools.partial(self._replay, records, routed) if routed else None)

    def _replay(self, records: dict[str, RecordedSequence], routed: list[ToReplay]) -> None:
        """Where the batch runs (the dispatch thread), just before: each datum's recorded routing,
        replayed in training whatever the loss (``rank.routing_replay``). Read there rather than
        where the request is checked (the event loop): it is ~100 times the rest of a record
        (Qwen3-30B-A3B: 768 bytes a token)."""
        recorded = self.sequences.routing(records, [run for r in routed for run in provenance.routing_runs(r.runs)])
        for r in routed:
            routing = provenance.routing(r.runs, r.length, recorded, r.where)
            if routing is not None:
                provenance.check_routing(routing, self.backend.capabilities, r.where)
                r.datum.routing = torch.from_numpy(routing)

    # ---- optimizer ------------------------------------------------------------------------

    def optim_step(self, req: wire.OptimStepRequest) -> str:
        def prepare(model: ModelRecord) -> Job:
            params = optimizers.step_params(req, model_optimizer(model), req.model_id)

            def job() -> tuple[bytes, str]:
                started = time.perf_counter()
                metrics = self.backend.trainer.optim_step(req.model_id, params)
                duration_s = time.perf_counter() - started
                self.events.weights_changed(req.model_id)
                result = json_result({"metrics": metrics})
                self.events.trained(Trained(req.model_id, req.seq_id, OPTIM_STEP, duration_s, 0, metrics))
                return result

            return job

        return self.submit_ordered("optim_step", req.model_id, req.seq_id, prepare)


def model_optimizer(model: ModelRecord) -> str:
    """The model's optimizer family (models stored before Dimuon existed are AdamW)."""
    return model.lora.get("optimizer", "adamw")


class ToReplay(NamedTuple):
    """A datum whose input runs (``runs``, from ``provenance.resolve``) have recorded routing."""

    datum: DatumInput
    length: int  # its input positions
    runs: list[tuple[int, Span]]
    where: str


def _failing(detail: str) -> Job:
    def job() -> tuple[bytes, str]:
        raise UserError(detail)

    return job
