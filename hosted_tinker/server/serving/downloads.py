"""Signed, expiring download links for checkpoint files and session traces: their own
credential, so the ``tinker`` CLI fetches external weights (and traces) without an API key. A
link names the file, the version of its checkpoint (when the record was created), the key it
was made for and its expiry, signed with the server's secret (HMAC-SHA256); nothing about it is
stored. At every fetch the link is checked again, as a request of that key would be: a
checkpoint deleted and made again under the same name is another version, and a key revoked,
or no longer allowed to read the checkpoint (its owner unpublished it) or the session, makes
its links stop serving at once, not when they expire."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path

from hosted_tinker.core.checkpoints import MANIFEST, CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import ApiError, not_found
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time

DOWNLOAD_URL_TTL_S = 3600
TRACE = "trace"  # the first field of a trace link's payload (a checkpoint file's is its run id)
# A link's payload is a short flat list (ids, names, times): a longer token is not one of ours,
# and is refused before it is decoded (nested brackets made the JSON decoder recurse: a 500).
MAX_TOKEN_CHARS = 4096


Version = Callable[[TinkerPath], float | None]  # a checkpoint's creation time; None: no such checkpoint
MayRead = Callable[[str, TinkerPath], bool]  # whether a tenant's key (still) may read a checkpoint
MayTrace = Callable[[str, str], bool]  # whether a tenant's key (still) may read a session


class DownloadLinks:
    def __init__(
        self, files: CheckpointFiles, secret: bytes, version: Version, may_read: MayRead, may_trace: MayTrace
    ) -> None:
        self.files = files
        self._secret = secret
        self._version = version
        self._may_read = may_read
        self._may_trace = may_trace

    def _sign(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()[:32]

    def urls(self, path: TinkerPath, base_url: str, tenant: str) -> rsp.ExternalWeightsUrlsResponse:
        """A link to each file of the checkpoint at ``path`` for ``tenant``'s key (which may read
        it now), all expiring together."""
        expires = int(time.time()) + DOWNLOAD_URL_TTL_S
        version = self._version(path)
        names = sorted(p.name for p in self.files.directory(path).iterdir() if p.name != MANIFEST)
        urls = {}
        for name in names:
            payload = json.dumps([path.run_id, path.kind, path.name, version, name, tenant, expires])
            token = payload.encode().hex()
            urls[name] = f"{base_url}/api/v1/files/{token}/{self._sign(payload)}/{name}"
        return rsp.ExternalWeightsUrlsResponse(urls=urls, expires=iso_time(expires).isoformat())

    def file(self, token: str, signature: str, asked_name: str) -> tuple[Path, str]:
        """The file a link names and the tenant it was made for, if its signature holds, it has
        not expired, ``asked_name`` (the link's last part, the name the file is served under) is
        the one it was made with, and that tenant's key may still read the checkpoint."""
        run_id, kind, name, version, file_name, tenant = self._opened(token, signature, 7)
        if not all(isinstance(f, str) for f in (run_id, kind, name, file_name, tenant)):
            raise not_found("no such download")
        path = TinkerPath(run_id, kind, name)
        file_path = self.files.directory(path) / file_name
        if asked_name != file_name:  # else a link could serve the file as, say, page.html
            raise not_found("no such download")
        if self._version(path) != version or not file_path.is_file():  # deleted, or made again since
            raise not_found("no such download")
        if not self._may_read(tenant, path):  # revoked, or unpublished since
            raise not_found("no such download")
        return file_path, tenant

    def trace_url(self, session_id: str, base_url: str, tenant: str) -> str:
        """A link to ``session_id``'s trace (``serving.traces``) for ``tenant``'s key, built when
        it is fetched."""
        payload = json.dumps([TRACE, session_id, tenant, int(time.time()) + DOWNLOAD_URL_TTL_S])
        return f"{base_url}/api/v1/traces/{payload.encode().hex()}/{self._sign(payload)}/{session_id}.json"

    def trace_session(self, token: str, signature: str, file_name: str) -> tuple[str, str]:
        """The session whose trace a link names and the tenant it was made for, if its signature
        holds, it has not expired, ``file_name`` is the one it was made with, and that tenant's
        key may still read the session."""
        tag, session_id, tenant = self._opened(token, signature, 4)
        if tag != TRACE or not isinstance(session_id, str) or file_name != f"{session_id}.json":
            raise not_found("no such download")
        if not isinstance(tenant, str) or not self._may_trace(tenant, session_id):  # its key revoked since
            raise not_found("no such download")
        return session_id, tenant

    def _opened(self, token: str, signature: str, size: int) -> list:
        """The fields of a link's payload (a JSON list of ``size``, the last its expiry), if its
        signature holds and it has not expired. Whatever a token holds, a 4xx."""
        try:
            if len(token) > MAX_TOKEN_CHARS:
                raise ValueError
            payload = bytes.fromhex(token).decode()
            *fields, expires = json.loads(payload)
            if not isinstance(expires, int):
                raise ValueError
        except (ValueError, TypeError, RecursionError):  # not hex, not JSON, not a list ending in a time
            raise not_found("no such download") from None
        # As bytes: compare_digest refuses a str with non-ASCII characters (a TypeError, a 500).
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()) or time.time() > expires:
            raise ApiError(403, "this download link is invalid or has expired")
        if len(fields) != size - 1:  # a link of another kind, or made before links named their key
            raise not_found("no such download")
        return fields
