"""Bringing your own adapter (SDK 0.39, ``serving.uploads``): start and finish an upload (keyed),
and the PUT of each file to its signed URL (keyless: the URL is the credential, as a download
link is). HTTP only."""

from __future__ import annotations

import asyncio
import errno

from fastapi import APIRouter, Request, Response
from starlette.requests import ClientDisconnect

from hosted_tinker.core.errors import ApiError, not_found
from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.errors import large_body
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.serving.uploads import Receiving

router = APIRouter(prefix="/api/v1", responses=rsp.TINKER_ERRORS)
files = APIRouter(prefix="/api/v1", responses=rsp.TINKER_ERRORS)  # signed: no API key
WRITE_BYTES = 1 << 20  # a PUT's bytes go to disk in pieces of about this, off the event loop


@router.post("/external_weights_upload_start", response_model=rsp.ExternalWeightsUploadStartResponse)
async def external_weights_upload_start(
    req: wire.ExternalWeightsUploadStartRequest, request: Request
) -> rsp.ExternalWeightsUploadStartResponse:
    base_url = str(request.base_url).rstrip("/")
    return await server_state(request).uploads.start(req, tenant_of(request), base_url)


@router.post("/external_weights_upload_finish", response_model=rsp.ExternalWeightsUploadFinishResponse)
async def external_weights_upload_finish(
    req: wire.ExternalWeightsUploadFinishRequest, request: Request
) -> rsp.ExternalWeightsUploadFinishResponse:
    uploads = server_state(request).uploads
    async with uploads.finishing:  # a few at a time: each reads and checks its files whole
        return await asyncio.to_thread(uploads.finish, req.upload_id, tenant_of(request))


@files.put(
    "/uploads/{upload_id}/{signature}/{file_name}", status_code=204, response_class=Response, **large_body("upload")
)
async def put_upload_file(upload_id: str, signature: str, file_name: str, request: Request) -> Response:
    """One file of an upload, streamed to disk: never more of it than its upload takes
    (413), never held whole in memory, nothing kept of a PUT that does not arrive whole."""
    state = server_state(request)
    receiving = state.uploads.receiving(upload_id, signature, file_name)
    try:
        request.state.tenant = receiving.upload.tenant  # its line in the request log names the upload's key
        if (over := state.quotas.admit(receiving.upload.tenant, "links")) is not None:
            raise over
        encoding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
        if encoding != "identity":
            raise ApiError(415, f"Content-Encoding {encoding!r}: PUT the file's own bytes, unencoded")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > receiving.max_bytes:
            raise _too_large(receiving.name, receiving.max_bytes)
        await _write(request, receiving)
        state.uploads.received(receiving)
    finally:
        state.uploads.ended(receiving)
    return Response(status_code=204)


async def _write(request: Request, receiving: Receiving) -> None:
    """The body into ``receiving.partial``, in pieces, each written off the event loop."""
    received, pending = 0, bytearray()
    try:
        with open(receiving.partial, "wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > receiving.max_bytes:
                    raise _too_large(receiving.name, receiving.max_bytes)
                pending += chunk
                if len(pending) >= WRITE_BYTES:
                    await asyncio.to_thread(out.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(out.write, bytes(pending))
    except FileNotFoundError:  # its upload was finished or expired since
        raise not_found("no such upload: it was finished, refused, or has expired") from None
    except ClientDisconnect:  # nobody hears the answer; nothing of the file is kept
        raise ApiError(400, f"the client went away before {receiving.name} was whole") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ApiError(507, "the server's disk is full; nothing of the file is kept") from None
        raise


def _too_large(name: str, limit: int) -> ApiError:
    return ApiError(413, f"{name} is larger than an export of this adapter's shape can be ({limit} bytes)")
