"""Signed, expiring download links for checkpoint files and session traces: their own
credential, so the ``tinker`` CLI fetches external weights (and traces) without an API key. A
link names the file, the version of its checkpoint (when the record was created) and its
expiry, signed with the server's secret (HMAC-SHA256); nothing about it is stored. A checkpoint
deleted and made again under the same name is another version: the old links no longer serve
it."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path

from hosted_tinker.core.checkpoints import MANIFEST, CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import ApiError, not_found
from hosted_tinker.server.protocol.responses import iso_time

DOWNLOAD_URL_TTL_S = 3600
TRACE = "trace"  # the first field of a trace link's payload (a checkpoint file's is its run id)


Version = Callable[[TinkerPath], float | None]  # a checkpoint's creation time; None: no such checkpoint


class DownloadLinks:
    def __init__(self, files: CheckpointFiles, secret: bytes, version: Version) -> None:
        self.files = files
        self._secret = secret
        self._version = version

    def _sign(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()[:32]

    def urls(self, path: TinkerPath, base_url: str) -> dict:
        """A link to each file of the checkpoint at ``path``, all expiring together."""
        expires = int(time.time()) + DOWNLOAD_URL_TTL_S
        version = self._version(path)
        names = sorted(p.name for p in self.files.directory(path).iterdir() if p.name != MANIFEST)
        urls = {}
        for name in names:
            payload = json.dumps([path.run_id, path.kind, path.name, version, name, expires])
            token = payload.encode().hex()
            urls[name] = f"{base_url}/api/v1/files/{token}/{self._sign(payload)}/{name}"
        return {"urls": urls, "expires": iso_time(expires).isoformat()}

    def file(self, token: str, signature: str, asked_name: str) -> Path:
        """The file a link names, if its signature holds, it has not expired and ``asked_name``
        (the link's last part, the name the file is served under) is the one it was made with."""
        run_id, kind, name, version, file_name = self._opened(token, signature, 6)
        path = TinkerPath(run_id, kind, name)
        file_path = self.files.directory(path) / file_name
        if asked_name != file_name:  # else a link could serve the file as, say, page.html
            raise not_found("no such download")
        if self._version(path) != version or not file_path.is_file():  # deleted, or made again since
            raise not_found("no such download")
        return file_path

    def trace_url(self, session_id: str, base_url: str) -> str:
        """A link to ``session_id``'s trace (``serving.traces``), built when it is fetched."""
        payload = json.dumps([TRACE, session_id, int(time.time()) + DOWNLOAD_URL_TTL_S])
        return f"{base_url}/api/v1/traces/{payload.encode().hex()}/{self._sign(payload)}/{session_id}.json"

    def trace_session(self, token: str, signature: str, file_name: str) -> str:
        """The session whose trace a link names, if its signature holds, it has not expired and
        ``file_name`` is the one it was made with."""
        tag, session_id = self._opened(token, signature, 3)
        if tag != TRACE or not isinstance(session_id, str) or file_name != f"{session_id}.json":
            raise not_found("no such download")
        return session_id

    def _opened(self, token: str, signature: str, size: int) -> list:
        """The fields of a link's payload (a JSON list of ``size``, the last its expiry), if its
        signature holds and it has not expired."""
        try:
            payload = bytes.fromhex(token).decode()
            *fields, expires = json.loads(payload)
            if len(fields) != size - 1 or not isinstance(expires, int):
                raise ValueError
        except (ValueError, TypeError):  # not hex, not JSON, not a list of ``size``
            raise not_found("no such download") from None
        # As bytes: compare_digest refuses a str with non-ASCII characters (a TypeError, a 500).
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()) or time.time() > expires:
            raise ApiError(403, "this download link is invalid or has expired")
        return fields
