"""Downloading an export and uploading an adapter as SDK 0.39's calls do (over HTTP: 0.39 is not
installable here): ``external_weights_upload_start``, a PUT of each file to its signed URL, then
``external_weights_upload_finish``."""

from __future__ import annotations

import httpx
import tinker

from tests.support.server import ALIAS

LORA = {"rank": 4, "train_attn": True, "train_mlp": True, "train_unembed": True}


def download(rest: tinker.RestClient, path: str) -> dict[str, bytes]:
    urls = rest.get_external_weights_urls(path).result().urls
    return {name: httpx.get(url, timeout=60).raise_for_status().content for name, url in urls.items()}


def start(base_url: str, key: str, **fields) -> httpx.Response:
    body = {"base_model": ALIAS, "lora_config": LORA} | fields
    return httpx.post(f"{base_url}/api/v1/external_weights_upload_start", json=body, headers={"X-API-Key": key})


def finish(base_url: str, key: str, upload_id: str) -> httpx.Response:
    url = f"{base_url}/api/v1/external_weights_upload_finish"
    return httpx.post(url, json={"upload_id": upload_id}, headers={"X-API-Key": key}, timeout=60)


def upload(base_url: str, key: str, files: dict[str, bytes], **fields) -> httpx.Response:
    """Start, PUT each file to its URL (no API key: the URL is the credential), finish."""
    started = start(base_url, key, **fields)
    assert started.status_code == 200, started.text
    for name, data in files.items():
        httpx.put(started.json()["urls"][name], content=data, timeout=60).raise_for_status()
    return finish(base_url, key, started.json()["upload_id"])
