"""Sampling helpers (a long prompt, asynchronous samples, a sampler) for the sampling-futures and vLLM tests."""

from __future__ import annotations

import httpx

from tests.support.server import ALIAS

LONG = {"max_tokens": 4000, "temperature": 1.0, "seed": 1, "stop": []}  # minutes of decoding on 2 cores


def _sampler(http: httpx.Client) -> str:
    session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": ALIAS}
    return http.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]


def _asample(http: httpx.Client, sampler: str, seq_id: int, params: dict, num_samples: int = 1) -> str:
    body = {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": num_samples,
        "prompt": PROMPT,
        "sampling_params": params,
    }
    r = http.post("/api/v1/asample", json=body)
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


PROMPT = {"chunks": [{"type": "encoded_text", "tokens": list(range(30, 45))}]}
