"""Batched sampling with a KV cache: the embedded engine's whole decode loop in one file.

Every request contributes ``num_samples`` rows. Prompts are left-padded, so all rows decode in
lock-step; finished rows leave the batch and newly arrived requests join it between steps. Each
row samples with its own seeded generator, so a request's output depends on its seed, not on
what else shares the batch (up to float rounding of the padded batch). Reported log-probs are
those of the model's own distribution (temperature 1, no top-k/top-p), which is what the trainer
computes for the same tokens; temperature, top-k and top-p only shape the sampling.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.logprobs import chunk_tokens_for, target_logprobs
from hosted_tinker.core.routing import NO_EXPERT, RECORD_DTYPE
from hosted_tinker.core.sampling import (
    MASK_LOGPROB,
    Admission,
    FinishListener,
    SampledSequence,
    SampleOutput,
    SampleSpec,
    TokenListener,
)
from hosted_tinker.rank.hf import CausalLM
from hosted_tinker.rank.routing_replay import RouterTape
from hosted_tinker.rank.vision import VisionTower


def _row_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + sample_index) % (2**63))
    return g


def _sampling_probs(logits: Tensor, spec: SampleSpec) -> Tensor:
    """The distribution a request samples from, per row of ``logits`` (..., V): temperature
    (> 0), then top-k, then top-p."""
    scaled = logits / spec.temperature
    if 0 < spec.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, spec.top_k).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, -1) - sorted_probs >= spec.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def _choose(logits: Tensor, specs: list[SampleSpec], generators: list[torch.Generator]) -> Tensor:
    """Each row's next token ``(R,)`` from ``logits`` ``(R, V)``, under its request's temperature /
    top-k / top-p and its own generator. Left on the device: reading a row's choice back
    (``int()``) would wait for the GPU once per row; the caller reads all of them at once.

    A row draws as ``torch.multinomial(probs, 1, generator=g)`` does (the same token, the same
    generator state after: its one-sample path is this race of exponential clocks), without
    the check of ``probs`` it reads back from the device first."""
    tokens = logits.argmax(-1)  # the greedy rows' choice; the others are drawn
    for r, spec in enumerate(specs):
        if spec.temperature != 0:
            probs = _sampling_probs(logits[r], spec)
            tokens[r] = (probs / torch.empty_like(probs).exponential_(generator=generators[r])).argmax()
    return tokens


_CHUNK = 1024  # prompt positions whose full-vocabulary rows are held at once


def _prompt_extras(
    head: nn.Module, hidden: Tensor, spec: SampleSpec, generator: torch.Generator
) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
    """Log-probs of ``target_prompt_ids`` (0.0 at -1), and ``prompt_alt_tokens_k`` draws with
    their log-probs, for prompt positions 1.. (row i: position i + 1). Draws use the request's
    temperature, top-k and top-p; reported log-probs are the model's own, as for sampled tokens."""
    n, ids, k = len(spec.prompt), spec.target_prompt_ids, spec.prompt_alt_tokens_k
    targets, alt, start_row = None, None, n - 1
    if ids is not None:
        targets = torch.zeros(ids.shape, dtype=torch.float32)
        named = (ids >= 0).any(-1).nonzero()
        start_row = int(named[0]) if len(named) else n - 1  # rows before the first id: not scored
    if k:
        alt = (torch.zeros((n - 1, k), dtype=torch.int64), torch.zeros((n - 1, k), dtype=torch.float32))
    first = 0 if k else start_row
    for start in range(first, n - 1, _CHUNK):
        end = min(start + _CHUNK, n - 1)
        logits = head(hidden[start:end]).float()  # row r predicts prompt position start + r + 1
        logp = torch.log_softmax(logits, -1)
        if ids is not None and targets is not None and end > start_row:  # (targets: made with ids)
            rows = ids[start:end].to(logp.device)
            scored = logp.gather(-1, rows.clamp(min=0)).masked_fill(rows < 0, 0.0)
            targets[start:end] = scored.cpu()
        if k and alt is not None:  # (alt: made with k)
            if spec.temperature == 0:
                drawn = logits.argmax(-1, keepdim=True).expand(-1, k)
            else:
                drawn = torch.multinomial(_sampling_probs(logits, spec), k, replacement=True, generator=generator)
            alt[0][start:end] = drawn.cpu()
            alt[1][start:end] = logp.gather(-1, drawn).cpu()
    return targets, alt


def _prompt_scores(
    head: nn.Linear, hidden: Tensor, prompt: list[int], spec: SampleSpec
) -> tuple[list[float] | None, tuple[Tensor, Tensor] | None]:
    """Prompt log-probs (position 0 and positions before ``last_n`` are NaN) and top-k rows."""
    n = len(prompt)
    first = 1 if spec.prompt_logprobs_last_n is None else max(1, n - spec.prompt_logprobs_last_n)
    logprobs = None
    if spec.prompt_logprobs:
        targets = torch.tensor(prompt[first:], device=hidden.device)[:, None]
        chunk = chunk_tokens_for(head.weight.shape[0])
        scored = target_logprobs(head, hidden[first - 1 : n - 1], targets, chunk)[:, 0].tolist()
        logprobs = [math.nan] * first + scored
    topk = None
    if spec.topk_prompt_logprobs > 0:
        k = spec.topk_prompt_logprobs
        ids = torch.zeros((n, k), dtype=torch.int32)
        lps = torch.full((n, k), MASK_LOGPROB, dtype=torch.float32)
        for start in range(first - 1, n - 1, 1024):
            end = min(start + 1024, n - 1)
            logp = torch.log_softmax(head(hidden[start:end]).float(), -1)
            values, indices = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            ids[start + 1 : end + 1, : values.shape[1]] = indices.int().cpu()
            lps[start + 1 : end + 1, : values.shape[1]] = values.cpu()
        topk = (ids, lps)
    return logprobs, topk


def _cache(out: Any) -> Any:  # a decoder's output, and its cache, of either transformers version
    """The decoder output's cache (``cache`` in transformers 5, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def _recurrent_states(layer: object) -> list[dict[int, Tensor | None]]:
    """A cache layer's per-row states of linear attention (Qwen3.5's Gated-DeltaNet: the causal
    convolution's window and the delta rule's state, batch first), if it has them."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer.conv_states, layer.recurrent_states] if isinstance(layer, LinearAttentionCacheLayerMixin) else []


@dataclass
class _Live:
    """The rows being decoded: row r is sample ``rows[r][1]`` of request ``rows[r][0]``.

    mask       (R, T) 1 for real tokens (prompts are left-padded)
    positions  (R, 1) position of each row's last token
    last       (R, H) hidden state of each row's last token
    """

    rows: list[tuple[int, int]]
    generators: list[torch.Generator]
    mask: Tensor
    positions: Tensor
    cache: Any  # the decoder's KV cache (transformers' DynamicCache, whose layers differ by version)
    last: Tensor

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[r] for r in keep]
        self.generators = [self.generators[r] for r in keep]
        self.mask, self.positions, self.last = self.mask[index], self.positions[index], self.last[index]
        for layer in self.cache.layers:
            for states in _recurrent_states(layer):
                for i, state in states.items():
                    states[i] = None if state is None else state[index]
            if hasattr(layer, "batch_select_indices"):  # keys and values (a linear-attention layer has none)
                layer.batch_select_indices(index)

    def merge(self, other: _Live) -> None:
        """Append ``other``'s rows, left-padding the shorter history so both line up."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: Tensor, dim: int, width: int = width) -> Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            # a linear-attention layer's states are one fixed-size tensor per row: no history to align
            for my_states, their_states in zip(_recurrent_states(mine), _recurrent_states(theirs), strict=True):
                for i, state in my_states.items():
                    if state is not None:
                        theirs_i = their_states[i]
                        if theirs_i is None:  # one layout of cache for every run of the model
                            raise RuntimeError("a run's linear-attention state is missing where another's is not")
                        my_states[i] = torch.cat([state, theirs_i])
            if hasattr(mine, "keys"):
                # a sliding-window layer keeps its last window - 1 positions only: both right-aligned
                # with the mask, the shorter left-padded, as a full layer's
                keys = max(mine.keys.shape[2], theirs.keys.shape[2])
                mine.keys = torch.cat([pad(mine.keys, 2, keys), pad(theirs.keys, 2, keys)])
                mine.values = torch.cat([pad(mine.values, 2, keys), pad(theirs.values, 2, keys)])
                if hasattr(mine, "cumulative_length"):  # positions seen, padding included: the mask's width
                    mine.cumulative_length = width
        self.mask = torch.cat([pad(self.mask, 1), pad(other.mask, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.rows += other.rows
        self.generators += other.generators


class Decode:
    """One decode run, which can stop between two steps and go on later where it stopped (its
    rows, their KV cache and generators kept here): the embedded engine decodes a long run in
    time slices, giving the worker to training and to other runs in between. Stopping changes
    nothing it samples: a step reads only the run's own state.

    Every request contributes ``num_samples`` rows; requests are numbered in the order they
    came in (``specs`` first, then admitted ones), for ``on_token`` and ``on_finished``.
    """

    def __init__(
        self,
        lm: CausalLM,
        specs: list[SampleSpec],
        *,
        pad_id: int,
        decode: Callable[[list[int]], str],
        default_seed: Callable[[], int],
        vision: VisionTower | None = None,
        replay: RouterTape | None = None,
    ) -> None:
        self.device = next(lm.parameters()).device
        self.vision = vision  # a vision-language model's tower, for prompts with images (``rank.vision``)
        # a mixture-of-experts model's routers, which record each token's experts for the
        # requests that ask (``SampleSpec.record_routing``): per (request, sample), per fed token
        self.replay = replay if replay is not None and replay.layers else None
        self.routed: dict[tuple[int, int], list[Tensor]] = {}
        self.decoder = getattr(lm, lm.base_model_prefix)
        # transformers 5 names the decoder's cache ``cache`` (``past_key_values`` goes in 5.40); 4.x the latter
        self.cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )
        self.head = lm.get_output_embeddings()
        self.pad_id, self.decode, self.default_seed = pad_id, decode, default_seed
        self.specs: list[SampleSpec] = []
        self.outputs: list[SampleOutput] = []
        self.best: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}  # (request, sample) -> per token
        self.unfinished: list[int] = []  # requests not yet reported finished, in order
        self.live = self._prefill(specs)

    @torch.no_grad()
    def _prefill(self, new: list[SampleSpec]) -> _Live:
        """Rows for the requests ``new``, their prompts run through the decoder (and scored, if
        asked); a request of ``max_tokens`` 0 has its output already."""
        first = len(self.outputs)
        self.specs.extend(new)
        self.outputs.extend(SampleOutput([SampledSequence() for _ in range(spec.num_samples)]) for spec in new)
        self.unfinished.extend(range(first, len(self.outputs)))
        specs, head, device = self.specs, self.head, self.device
        rows = [(first + i, s) for i, spec in enumerate(new) for s in range(spec.num_samples)]
        seeds = [spec.seed if spec.seed is not None else self.default_seed() for spec in new]
        generators = [_row_generator(seeds[i - first], s, device) for i, s in rows]
        longest = max(len(spec.prompt) for spec in new)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for r, (i, _) in enumerate(rows):
            prompt = specs[i].prompt
            ids[r, longest - len(prompt) :] = torch.tensor(prompt)
            mask[r, longest - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs: dict[str, Tensor | list[Tensor]] = {"input_ids": ids, "position_ids": positions}
        if placed := [
            (r, longest - len(specs[i].prompt), len(specs[i].prompt), specs[i].images)
            for r, (i, _) in enumerate(rows)
            if specs[i].images
        ]:
            where = [f"request {i}: prompt" for i, _ in rows if specs[i].images]
            if self.vision is None:  # the server refuses images for a model without a tower
                raise UserError("this model takes no images")
            inputs = self.vision.embed(self.decoder.get_input_embeddings(), ids, positions, placed, where)
            # the rows decode on from past their prompt's largest M-RoPE position (an image's
            # positions advance less than its tokens do); text alone: the same as its count
            positions = inputs["position_ids"][1]
        recording = [r for r, (i, s) in enumerate(rows) if s == 0 and specs[i].record_routing]  # a prompt once
        with self._recording(recording, longest) as taken:
            out = self.decoder(attention_mask=mask, use_cache=True, **inputs)
            routed = taken()  # (layers, recording rows, longest, top_k), or None
        hidden = out.last_hidden_state  # (rows, longest, H)
        if routed is not None:
            for j, r in enumerate(recording):
                i = rows[r][0]
                chosen = routed[:, j, longest - len(specs[i].prompt) :].transpose(0, 1)  # (P, layers, top_k)
                self.outputs[i].prompt_routing = chosen.cpu().numpy()
        for r, (i, s) in enumerate(rows):
            spec, output = specs[i], self.outputs[i]
            if s == 0 and spec.scores_prompt:
                row_hidden = hidden[r, longest - len(spec.prompt) :]
                output.prompt_logprobs, output.topk_prompt = _prompt_scores(head, row_hidden, spec.prompt, spec)
                # Alternative draws have a generator of their own: the samples' do not move.
                extras_generator = _row_generator(seeds[i - first], spec.num_samples, device)
                output.target_prompt, output.prompt_alt = _prompt_extras(head, row_hidden, spec, extras_generator)
        live = _Live(rows, generators, mask, positions[:, -1:], _cache(out), hidden[:, -1])
        live.select([r for r, (i, _) in enumerate(rows) if specs[i].max_tokens > 0])
        return live

    @torch.no_grad()
    def run(
        self,
        admit: Callable[[], Admission] | None = None,
        on_token: TokenListener | None = None,
        on_finished: FinishListener | None = None,
    ) -> bool:
        """Decode until the run ends (True) or ``admit`` says its slice is over (False: call again
        to go on). Between decode steps, ``admit`` may hand over more requests (same weights):
        they are prefilled and join the running rows, so a request never waits for a whole run
        to end; and it may name requests to drop, whose rows leave with what they have so far.
        ``on_token`` hears every token of a ``stream`` spec; ``on_finished`` each request's
        output as soon as its last row has left, before the run ends."""
        self._report(on_finished)
        while self.live.rows:
            self._step(on_token)
            admission = admit() if admit is not None else Admission()
            if admission.dropped:
                gone = set(admission.dropped)
                keep = [r for r, (i, _) in enumerate(self.live.rows) if i not in gone]
                if len(keep) < len(self.live.rows):
                    self.live.select(keep)
            if arrivals := admission.arrivals:
                joined = self._prefill(arrivals)
                if self.live.rows:
                    self.live.merge(joined)
                else:
                    self.live = joined
            self._report(on_finished)
            if admission.pause and self.live.rows:
                return False
        return True

    def _step(self, on_token: TokenListener | None) -> None:
        """One token for every live row; finished rows leave; the others' next state."""
        specs, live = self.specs, self.live
        logits = self.head(live.last).float()  # (R, V)
        logp = torch.log_softmax(logits, -1)
        top = _top_k_rows(logp, [specs[i].topk_sample_logprobs for i, _ in live.rows])
        picked = _choose(logits, [specs[i] for i, _ in live.rows], live.generators)
        # The step's one wait for the device (the log-probs' copy follows it at once).
        tokens, token_logprobs = picked.tolist(), logp.gather(-1, picked[:, None])[:, 0].tolist()
        keep = []
        for r, (i, s) in enumerate(live.rows):
            spec, seq, token = specs[i], self.outputs[i].sequences[s], tokens[r]
            seq.tokens.append(token)
            seq.logprobs.append(token_logprobs[r])
            if r in top:
                self.best.setdefault((i, s), []).append(top[r])
            if spec.stream and on_token is not None:
                on_token(i, s, token, seq.logprobs[-1])
            if token in spec.stop_token_ids or _hit_stop_string(seq.tokens, spec.stop_strings, self.decode):
                seq.stop_reason = "stop"
            elif len(seq.tokens) < spec.max_tokens:
                keep.append(r)
        if len(keep) < len(live.rows):
            live.select(keep)  # finished rows leave the batch
            picked = picked[torch.tensor(keep, dtype=torch.long, device=picked.device)]
        if live.rows:
            live.mask = torch.cat([live.mask, live.mask.new_ones((len(live.rows), 1))], dim=1)
            live.positions = live.positions + 1
            recording = [r for r, (i, _) in enumerate(live.rows) if specs[i].record_routing]
            with self._recording(recording, 1) as taken:
                out = self.decoder(
                    input_ids=picked[:, None],
                    attention_mask=live.mask,
                    position_ids=live.positions,
                    use_cache=True,
                    **{self.cache_kwarg: live.cache},
                )
                routed = taken()  # (layers, recording rows, 1, top_k): the tokens just sampled, fed back
            live.cache, live.last = _cache(out), out.last_hidden_state[:, -1]
            if routed is not None:  # kept on the device: read back once, when the request is done
                for j, r in enumerate(recording):
                    self.routed.setdefault(live.rows[r], []).append(routed[:, j, 0])

    @contextlib.contextmanager
    def _recording(self, rows: list[int], width: int) -> Iterator[Callable[[], Tensor | None]]:
        """Around one decoder call over rows of ``width`` positions: the experts its routers chose
        for ``rows`` (those of requests that record their routing), ``(layers, len(rows), width,
        top_k)``; a function giving None where no row records."""
        if self.replay is None or not rows:
            yield lambda: None
            return
        index = torch.tensor(rows, device=self.device)
        with self.replay.recording(lambda chosen: chosen.view(-1, width, chosen.shape[-1])[index]) as taken:
            yield taken

    def _report(self, on_finished: FinishListener | None) -> None:
        """Each request none of whose rows is left is finished: its top-k rows are put together
        and ``on_finished`` hears it (once)."""
        decoding = {i for i, _ in self.live.rows}
        done = [i for i in self.unfinished if i not in decoding]
        if not done:
            return
        self.unfinished = [i for i in self.unfinished if i in decoding]
        for i in done:
            for s, seq in enumerate(self.outputs[i].sequences):
                if rows := self.best.pop((i, s), None):
                    seq.topk = (np.stack([ids for ids, _ in rows]), np.stack([lps for _, lps in rows]))
                if self.replay is not None and self.specs[i].record_routing:
                    fed = self.routed.pop((i, s), [])
                    seq.routing = np.full(
                        (len(seq.tokens), self.replay.layers, self.replay.top_k), NO_EXPERT, RECORD_DTYPE
                    )
                    if fed:
                        seq.routing[: len(fed)] = torch.stack(fed).cpu().numpy()
            if on_finished is not None:
                on_finished(i, self.outputs[i])


def generate(
    lm: CausalLM,
    specs: list[SampleSpec],
    *,
    pad_id: int,
    decode: Callable[[list[int]], str],
    default_seed: Callable[[], int],
    admit: Callable[[], Admission] | None = None,
    on_token: TokenListener | None = None,
    vision: VisionTower | None = None,
    replay: RouterTape | None = None,
) -> list[SampleOutput]:
    """Sample every request of ``specs`` in one ``Decode`` run to its end (``lm``: a causal LM
    with its adapter set); one output per request, ``specs`` first, then admitted ones."""
    run = Decode(lm, specs, pad_id=pad_id, decode=decode, default_seed=default_seed, vision=vision, replay=replay)
    while not run.run(admit, on_token):
        pass  # a pause asked for here has no one to give the worker to
    return run.outputs


def _top_k_rows(logp: Tensor, ks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Row r's ``ks[r]`` best token ids (int32) and log-probs (float32) of ``logp`` ``(R, V)``,
    for the rows that ask (k > 0): one top-k over them all and one copy to the host per step."""
    asked = [r for r, k in enumerate(ks) if k > 0]
    if not asked:
        return {}
    values, indices = torch.topk(logp[asked], min(max(ks), logp.shape[-1]), dim=-1)  # sorted, best first
    ids, lps = indices.to(torch.int32).cpu().numpy(), values.cpu().numpy()
    return {r: (ids[j, : ks[r]], lps[j, : ks[r]]) for j, r in enumerate(asked)}


def _hit_stop_string(tokens: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> bool:
    """Does the generated text end with, or newly contain, a stop string? Only the tail is decoded."""
    if not stops:
        return False
    tail = decode(tokens[-(max(len(s) for s in stops) + 8) :])
    return any(stop in tail for stop in stops)
