"""Console sign-in: a key typed once becomes a signed cookie, and forms carry a CSRF token.

The cookie holds the SHA-256 of the key (never the key), when it expires (in milliseconds), and
an HMAC of both under the server's secret; each request resolves the digest through ``KeyRing``
again, so a revoked key's cookies stop working at once. Signing out is recorded on the server
(``Store.console_sign_out``): every cookie of that key made until then is refused from then on,
so a copy of the cookie is worth nothing after its browser signed out (a browser's forgetting
the cookie was all there was, and a copy kept working for 12 hours). It is ``HttpOnly`` (no script reads it),
``SameSite=Lax`` (no other site's page sends it with a POST; a link from elsewhere still opens
a page signed in, and no GET changes anything) and ``Secure`` over HTTPS.

Every form that changes something (sign out, delete, publish) carries ``csrf_token(cookie)``, an
HMAC of the cookie under a key of its own: a page elsewhere can neither read the cookie nor
compute the token. The sign-in form, before any cookie exists, pairs a random nonce cookie with
the same nonce in the form (double submit), so that no other site can sign a browser in to its
own key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE = "ht_console"
NONCE_COOKIE = "ht_console_signin"
LIFETIME_S = 12 * 3600.0
PATH = "/console"


def _derived(secret: bytes, purpose: str) -> bytes:
    """A key of its own per use of the server's secret (download links sign with it too)."""
    return hmac.new(secret, f"hosted-tinker console {purpose}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class SignedIn:
    digest: str  # the SHA-256 of the key signed in with
    expires_at: float
    issued_at: float  # when the cookie was made: a sign-out of its key since refuses it


class ConsoleSignIn:
    """Makes and checks the console's cookies and CSRF tokens (pure: no I/O)."""

    def __init__(self, secret: bytes, lifetime_s: float = LIFETIME_S) -> None:
        self._cookie_key = _derived(secret, "cookie")
        self._csrf_key = _derived(secret, "csrf")
        self.lifetime_s = lifetime_s

    def _mac(self, key: bytes, message: str) -> str:
        return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()

    def cookie(self, key_digest: str, now: float | None = None) -> str:
        """The cookie's value for a key (by its SHA-256), valid for ``lifetime_s``."""
        expires_ms = int(((time.time() if now is None else now) + self.lifetime_s) * 1000)
        body = f"{key_digest}.{expires_ms}"
        return f"{body}.{self._mac(self._cookie_key, body)}"

    def verify(self, value: str | None, now: float | None = None) -> SignedIn | None:
        """What a cookie stands for, or None if it is absent, forged, garbled or expired."""
        if not value or value.count(".") != 2:
            return None
        digest, expires, mac = value.split(".")
        if not _same(mac, self._mac(self._cookie_key, f"{digest}.{expires}")):
            return None
        if not expires.isdigit():
            return None
        expires_at = int(expires) / 1000
        if expires_at <= (time.time() if now is None else now):
            return None
        return SignedIn(digest=digest, expires_at=expires_at, issued_at=expires_at - self.lifetime_s)

    def csrf_token(self, cookie: str) -> str:
        """The token every changing form of this cookie's pages carries."""
        return self._mac(self._csrf_key, cookie)

    def csrf_ok(self, cookie: str | None, token: str | None) -> bool:
        return bool(cookie and token) and _same(self.csrf_token(cookie or ""), token or "")


def new_nonce() -> str:
    return secrets.token_urlsafe(24)


def nonce_ok(cookie: str | None, submitted: str | None) -> bool:
    """The sign-in form's double submit: its nonce field equals the nonce cookie."""
    return bool(cookie and submitted) and _same(cookie or "", submitted or "")


def _same(a: str, b: str) -> bool:
    """A constant-time comparison of two strings from a request (as bytes: ``compare_digest``
    refuses ``str`` with non-ASCII characters, which a cookie or a form can hold)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape"))
