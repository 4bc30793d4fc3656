"""The console's routes: HTML pages, the forms that change something, and the JSON its charts
read. HTTP only: what a page shows comes from ``views``, who is signed in from ``signin``.

Pages answer a browser that is not signed in with a redirect to the sign-in page; the JSON
answers 401. Every POST carries the CSRF token of its cookie (``signin``), or is a 403.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.api.state import ServerState, server_state
from hosted_tinker.server.console import views
from hosted_tinker.server.console.signin import COOKIE, NONCE_COOKIE, PATH, new_nonce, nonce_ok
from hosted_tinker.server.keys import key_hash

HERE = Path(__file__).parent
STATIC = HERE / "static"
OPEN_DIGEST = "open"  # what the cookie of a server without keys holds: no key was typed

templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["when"] = views.when
templates.env.filters["size"] = views.size
router = APIRouter(prefix=PATH, include_in_schema=False)


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in browser's tenant, and whether it may see the server pages."""

    tenant: str
    operator: bool
    csrf: str  # the token its forms carry
    digest: str  # of the key its cookie names (``signin.SignedIn``)


class NotSignedIn(Exception):
    """Raised by ``viewer``; the app answers it with a redirect (pages) or a 401 (JSON)."""


async def viewer(request: Request) -> Viewer:
    """The dependency of every signed-in route (``async``: a plain one would cost each request a
    thread-pool round trip)."""
    state = server_state(request)
    cookie = request.cookies.get(COOKIE)
    signed = state.console.verify(cookie)
    tenant = state.keys.tenant_of_digest(signed.digest) if signed is not None else None
    if signed is None or tenant is None:
        raise NotSignedIn
    if signed.digest == OPEN_DIGEST and state.keys.required:  # keys were turned on since
        raise NotSignedIn
    signed_out = state.store.console_signed_out_at(signed.digest)
    if signed_out is not None and signed.issued_at <= signed_out:  # made before its key signed out
        raise NotSignedIn
    if (over := state.quotas.admit(tenant)) is not None:  # the key's requests per second, as on the API
        raise over
    request.scope.setdefault("state", {})["tenant"] = tenant  # the request log names its key
    csrf = state.console.csrf_token(cookie or "")
    return Viewer(tenant=tenant, operator=state.is_operator(tenant), csrf=csrf, digest=signed.digest)


Signed = Annotated[Viewer, Depends(viewer)]


MAX_FORM_BYTES = 8 << 10  # a console form holds a key, a token or two
MAX_FORM_FIELDS = 8


async def form(request: Request) -> dict[str, str]:
    """An url-encoded form's fields. Read up to ``MAX_FORM_BYTES`` only: the sign-in form is
    open to anyone, and parsing a 1 MiB body of empty fields would hold the event loop."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise ApiError(413, f"a console form is at most {MAX_FORM_BYTES} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ApiError(413, f"a console form is at most {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
    except ValueError:
        raise ApiError(400, f"a console form has at most {MAX_FORM_FIELDS} fields") from None
    return {name: values[-1] for name, values in fields.items()}


async def checked_form(request: Request) -> dict[str, str]:
    """The form of a change, if it carries this browser's CSRF token and was not sent by another
    site's page (``Sec-Fetch-Site``, which browsers set and pages cannot; unlike ``Origin``
    against ``Host`` it holds behind a proxy that rewrites the host or ends TLS)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise ApiError(403, "a console form must come from the console's own pages")
    fields = await form(request)
    if not server_state(request).console.csrf_ok(request.cookies.get(COOKIE), fields.get("csrf_token")):
        raise ApiError(403, "the form's CSRF token is missing or not this session's: reload the page")
    return fields


def page(request: Request, name: str, who: Viewer | None, status_code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"who": who, **context}, status_code=status_code)


def missing_page(request: Request, who: Viewer, what: str) -> HTMLResponse:
    return page(request, "missing.html", who, status_code=404, what=what)


# ---- signing in and out ----------------------------------------------------------------------


def _next(target: str | None) -> str:
    """Where to go after signing in: a console page of this server, never another site."""
    if target and target.startswith(f"{PATH}/") and not target.startswith("//") and "\\" not in target:
        return target
    return f"{PATH}/runs"


@router.get("")
async def home() -> RedirectResponse:
    return RedirectResponse(f"{PATH}/runs", status_code=303)


@router.get("/signin")
async def signin_page(request: Request, next: str | None = None) -> HTMLResponse:
    nonce = new_nonce()
    state = server_state(request)
    response = page(request, "signin.html", None, nonce=nonce, next=_next(next), needs_key=state.keys.required)
    _set_cookie(request, response, NONCE_COOKIE, nonce, max_age=3600)
    return response


@router.post("/signin")
async def signin(request: Request) -> Response:
    state = server_state(request)
    if not request.cookies.get(NONCE_COOKIE):  # before reading a byte of the body
        raise ApiError(403, "the sign-in form has expired or came from another site: reload it")
    fields = await form(request)
    target = _next(fields.get("next"))
    if not nonce_ok(request.cookies.get(NONCE_COOKIE), fields.get("nonce")):
        raise ApiError(403, "the sign-in form has expired or came from another site: reload it")
    key = (fields.get("key") or "").strip()
    if state.keys.required:
        if state.keys.tenant_of(key) is None:
            nonce = new_nonce()
            response: Response = page(
                request, "signin.html", None, status_code=401, nonce=nonce, next=target, needs_key=True,
                error="That key is not valid here (or it was revoked).",
            )  # fmt: skip
            _set_cookie(request, response, NONCE_COOKIE, nonce, max_age=3600)
            return response
        digest = key_hash(key)
    else:
        digest = OPEN_DIGEST
    response = RedirectResponse(target, status_code=303)
    _set_cookie(request, response, COOKIE, state.console.cookie(digest), max_age=int(state.console.lifetime_s))
    response.delete_cookie(NONCE_COOKIE, path=PATH)
    return response


@router.post("/signout")
async def signout(request: Request, who: Signed) -> RedirectResponse:
    """Signs out every browser of this key: its cookies made until now are refused on the
    server, not only forgotten by this browser (one row per key, however often it signs out)."""
    await checked_form(request)
    state, now = server_state(request), time.time()
    state.store.console_sign_out(who.digest, now, forget_before=now - state.console.lifetime_s)
    response = RedirectResponse(f"{PATH}/signin", status_code=303)
    response.delete_cookie(COOKIE, path=PATH)
    return response


def _set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    secure = request.url.scheme == "https"
    response.set_cookie(name, value, max_age=max_age, path=PATH, httponly=True, samesite="lax", secure=secure)


# ---- runs ------------------------------------------------------------------------------------


@router.get("/runs")
async def runs_page(request: Request, who: Signed, offset: int = Query(0, ge=0, le=2**62)) -> HTMLResponse:
    listed = await asyncio.to_thread(views.runs, server_state(request), who.tenant, offset)
    return page(request, "runs.html", who, **listed)


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str, who: Signed) -> HTMLResponse:
    try:
        base_url = str(request.base_url).rstrip("/")
        run = await asyncio.to_thread(views.run, server_state(request), who.tenant, run_id, base_url)
    except ApiError as e:
        if e.status == 404:
            return missing_page(request, who, f"training run {run_id!r}")
        raise
    return page(request, "run.html", who, run=run)


@router.get("/api/runs/{run_id}/metrics")
async def run_metrics(
    request: Request,
    run_id: str,
    who: Signed,
    after: int = Query(-1, ge=-1, le=2**62),
    limit: int = Query(500, ge=1, le=1000),
) -> dict:
    """The run's closed steps for its charts (``GET /api/v1/training_runs/{id}/metrics``'s,
    without the open step, which the charts do not draw)."""
    state = server_state(request)
    state.tenancy.run(who.tenant, run_id)
    return await asyncio.to_thread(state.run_metrics.steps, run_id, after, limit, False)


CHANGES = {"delete", "publish", "unpublish"}


@router.post("/runs/{run_id}/checkpoints/{kind}/{name}/{change}")
async def change_checkpoint(request: Request, run_id: str, kind: str, name: str, change: str, who: Signed) -> Response:
    await checked_form(request)
    state = server_state(request)
    if change not in CHANGES:
        return missing_page(request, who, f"action {change!r}")
    try:
        state.tenancy.run(who.tenant, run_id)
        await asyncio.to_thread(_change, state, run_id, f"{kind}/{name}", change, who.tenant)
    except ApiError as e:
        if e.status == 404:
            return missing_page(request, who, f"checkpoint {kind}/{name} of {run_id!r}")
        raise
    return RedirectResponse(f"{PATH}/runs/{quote(run_id)}#checkpoints", status_code=303)


def _change(state: ServerState, run_id: str, checkpoint_id: str, change: str, actor: str) -> None:
    """The same calls as the REST routes' (deleting a large adapter's files takes a while: a thread)."""
    if change == "delete":
        state.checkpoints.delete(run_id, checkpoint_id, actor)
    else:
        state.checkpoints.set_public(run_id, checkpoint_id, change == "publish", actor)


# ---- the server (operators) ------------------------------------------------------------------


@router.get("/server")
async def server_page(request: Request, who: Signed) -> HTMLResponse:
    if not who.operator:
        return page(request, "missing.html", who, status_code=403, what="the server page (an operator key's)")
    state = server_state(request)
    errors = await asyncio.to_thread(views.recent_errors, Path(state.config.request_log_target()))
    shown = await asyncio.to_thread(views.server, state)  # a few queries per key
    return page(request, "server.html", who, errors=errors, **shown)


def not_signed_in(request: Request, _: NotSignedIn) -> Response:
    """The app's answer to ``NotSignedIn``: the sign-in page for pages, a 401 for the JSON."""
    if request.url.path.startswith(f"{PATH}/api/"):
        return JSONResponse({"detail": "not signed in to the console"}, status_code=401)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"{PATH}/signin?next={quote(target)}", status_code=303)
