"""Signed, expiring download links for checkpoint files: their own credential, so the ``tinker``
CLI fetches external weights without an API key. A link names the file and its expiry, signed
with the server's secret (HMAC-SHA256); nothing about it is stored."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path

from hosted_tinker.core.checkpoints import MANIFEST, CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import ApiError, not_found
from hosted_tinker.server.protocol.responses import iso_time

DOWNLOAD_URL_TTL_S = 3600


class DownloadLinks:
    def __init__(self, files: CheckpointFiles, secret: bytes) -> None:
        self.files = files
        self._secret = secret

    def _sign(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()[:32]

    def urls(self, path: TinkerPath, base_url: str) -> dict:
        """A link to each file of the checkpoint at ``path``, all expiring together."""
        expires = int(time.time()) + DOWNLOAD_URL_TTL_S
        names = sorted(p.name for p in self.files.directory(path).iterdir() if p.name != MANIFEST)
        urls = {}
        for name in names:
            payload = json.dumps([path.run_id, path.kind, path.name, name, expires])
            token = payload.encode().hex()
            urls[name] = f"{base_url}/api/v1/files/{token}/{self._sign(payload)}/{name}"
        return {"urls": urls, "expires": iso_time(expires).isoformat()}

    def file(self, token: str, signature: str) -> Path:
        """The file a link names, if its signature holds and it has not expired."""
        try:
            payload = bytes.fromhex(token).decode()
            run_id, kind, name, file_name, expires = json.loads(payload)
        except (ValueError, TypeError):  # not hex, not JSON, not a list of five
            raise not_found("no such download") from None
        if not hmac.compare_digest(self._sign(payload), signature) or time.time() > expires:
            raise ApiError(403, "this download link is invalid or has expired")
        file_path = self.files.directory(TinkerPath(run_id, kind, name)) / file_name
        if not file_path.is_file():
            raise not_found("no such download")
        return file_path
