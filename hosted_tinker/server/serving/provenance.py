"""Provenance spans, checked against what the sampler recorded (``server.persistence.sequences``).

A datum's ``model_input_spans`` tile its input tokens and its ``loss_fn_input_spans`` tile its
targets; each run claims that those positions are a stretch of a recorded sequence's prompt
or of its sampled tokens. Every claim is checked against the record, so a loss that uses the
record (``stable_reinforce``) uses it for exactly the tokens the sampler chose:

- the runs tile their field exactly, and stay inside the named sequence;
- input positions equal the recorded tokens they claim (prompt or sampled): the context the
  learner sees is the one the sampler saw;
- target positions claimed as sampled equal the recorded sampled tokens. Targets claimed as
  prompt are not compared: a recipe may put placeholders there (they carry no loss).

What comes out, per target position: whether it is a sampled token (``sampled_mask``) and
the sampler's recorded log-prob of it (0 elsewhere); and per input position, on a
mixture-of-experts model, the experts the sampler routed that token to, for training to replay
(``routing``; -1 where nothing was recorded, as for the last sampled token, never fed back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from hosted_tinker.core.errors import ApiError, bad_request
from hosted_tinker.core.types import Capabilities
from hosted_tinker.server.persistence.sequences import RecordedSequence, RoutingRun
from hosted_tinker.server.protocol.proto_codec import Span, WireDatum

# The client's copy of the sampler's log-probs went through float32 on the wire, as the
# record did: equal up to rounding, or the datum is not what was sampled.
LOGPROB_TOLERANCE = 1e-5


@dataclass
class Resolved:
    """Per target position ``(N,)``: 1.0 where it is a sampled token, and the sampler's log-prob;
    by the names of a loss's ``recorded_inputs`` (``inputs``). ``routed``: the input runs whose
    record holds routing, each with its first position, for ``routing``."""

    sampled_mask: np.ndarray
    logprobs: np.ndarray
    routed: list[tuple[int, Span]] = field(default_factory=list)

    def inputs(self) -> dict[str, np.ndarray]:
        return {"sampled_mask": self.sampled_mask, "logprobs": self.logprobs}


def sequence_ids(datum: WireDatum) -> set[str]:
    return {s.sequence_id for s in (*datum.model_input_spans, *datum.loss_fn_input_spans)}


def unknown_sequence(where: str, sequence_id: str) -> ApiError:
    return bad_request(
        f"{where}: sequence_id {sequence_id!r} has no record in this session: it was not sampled with "
        "record_stability_info=True, its record expired (one day after its last use), or another session sampled it"
    )


def check_tiling(datum: WireDatum, where: str) -> None:
    """Each field's runs cover it exactly (before any record is looked up)."""
    n = len(datum.tokens)
    for name in ("model_input_spans", "loss_fn_input_spans"):
        covered = sum(s.length for s in getattr(datum, name))
        if covered != n:
            raise bad_request(
                f"{where}.{name} cover {covered} positions; the field has {n}: the runs must tile it exactly"
            )


def resolve(
    datum: WireDatum, where: str, records: dict[str, RecordedSequence], *, require_records: bool = True
) -> Resolved:
    """Check the datum's spans (tiled: ``check_tiling``) against ``records``, the live records of
    the model's session. Without ``require_records`` (a loss that does not read them), a span
    naming a sequence with no record is taken as the label it is: tinker-cookbook attaches
    provenance to every RL datum, whatever the loss and whether or not its sampler recorded."""
    targets = datum.loss_fn_inputs["target_tokens"]
    n = len(datum.tokens)
    walk = functools.partial(_walk, records=records, require_records=require_records)
    inputs = walk(datum.model_input_spans, f"{where}.model_input_spans", datum.tokens, check_prompt=True)
    mask = np.zeros(n, dtype=np.float32)
    logprobs = np.zeros(n, dtype=np.float32)
    for pos, span, rec in walk(datum.loss_fn_input_spans, f"{where}.loss_fn_input_spans", targets, check_prompt=False):
        if span.sampled:
            mask[pos : pos + span.length] = 1.0
            logprobs[pos : pos + span.length] = rec.logprobs[span.offset : span.offset + span.length]
    return Resolved(mask, logprobs, [(pos, span) for pos, span, rec in inputs if rec.routed])


def routing_runs(routed: list[tuple[int, Span]]) -> list[RoutingRun]:
    """What ``SequenceRecords.routing`` reads for ``resolve``'s routed runs."""
    return [_run(span) for _, span in routed]


def routing(
    routed: list[tuple[int, Span]], n: int, recorded: dict[RoutingRun, np.ndarray], where: str
) -> np.ndarray | None:
    """The recorded experts of each of a datum's ``n`` input positions (-1 where none), from the
    runs ``resolve`` found routed and their ``recorded`` routing (``SequenceRecords.routing``);
    None if none holds any (a dense model, or a sampler that does not record it)."""
    routing: np.ndarray | None = None
    for pos, span in routed:
        source = recorded.get(_run(span))
        if source is None:
            continue
        if routing is None:
            routing = np.full((n, *source.shape[1:]), -1, dtype=np.int16)
        elif source.shape[1:] != routing.shape[1:]:
            raise bad_request(f"{where}.model_input_spans: the sequences it names were sampled from different models")
        routing[pos : pos + len(source)] = source
    return routing


def _run(span: Span) -> RoutingRun:
    return (span.sequence_id, span.sampled, span.offset, span.length)


def _walk(
    spans: list[Span],
    where: str,
    tokens: np.ndarray,
    *,
    records: dict[str, RecordedSequence],
    require_records: bool,
    check_prompt: bool,
) -> list[tuple[int, Span, RecordedSequence]]:
    """Each recorded span with its first position and its record, after checking bounds and tokens."""
    out, pos = [], 0
    for j, span in enumerate(spans):
        rec = records.get(span.sequence_id)
        if rec is None:
            if require_records:
                raise unknown_sequence(f"{where}[{j}]", span.sequence_id)
            pos += span.length
            continue
        source = rec.tokens if span.sampled else rec.prompt
        name = "sampled tokens" if span.sampled else "prompt"
        if span.offset + span.length > len(source):
            raise bad_request(
                f"{where}[{j}]: positions [{span.offset}, {span.offset + span.length}) are outside the {name} of "
                f"sequence {span.sequence_id!r} ({len(source)} tokens)"
            )
        if span.sampled or check_prompt:
            got = tokens[pos : pos + span.length]
            if got.ndim > 1:  # (N, K) targets: the first column is the token the span claims
                got = got[:, 0]
            want = source[span.offset : span.offset + span.length]
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                raise bad_request(
                    f"{where}[{j}]: position {pos + i} holds token {int(got[i])}, but the {name} of sequence "
                    f"{span.sequence_id!r} has {int(want[i])} at {span.offset + i}"
                )
        out.append((pos, span, rec))
        pos += span.length
    return out


def check_client_logprobs(client: np.ndarray, resolved: Resolved, where: str) -> None:
    """The client may send the sampler's log-probs too; on sampled tokens they must be the record's."""
    on = resolved.sampled_mask != 0
    diff = np.abs(client[on] - resolved.logprobs[on])
    if diff.size and float(diff.max()) > LOGPROB_TOLERANCE:
        i = int(np.flatnonzero(on)[int(diff.argmax())])
        raise bad_request(
            f"{where}.loss_fn_inputs.logprobs[{i}] = {float(client[i]):.6g}, but the sampler recorded "
            f"{float(resolved.logprobs[i]):.6g} for that token; stable_reinforce uses the record (send the "
            "sampler's log-probs, or none)"
        )


def check_routing(routing: np.ndarray, caps: Capabilities, where: str) -> None:
    """Recorded routing is replayed only on the model that recorded it: records outlive a restart
    of the server, which may load another checkpoint."""
    layers, top_k = caps.replay_routing
    if routing.shape[1:] != (layers, top_k) or int(routing.max()) >= caps.routed_experts:
        raise bad_request(
            f"{where}.model_input_spans name sequences sampled from another model than this server's "
            f"({routing.shape[1]} mixture-of-experts layers, {routing.shape[2]} experts per token; this one has "
            f"{layers} and {top_k} of {caps.routed_experts}): sample again"
        )
