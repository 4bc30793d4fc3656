"""API keys, and the tenant each one stands for.

A key is ``tml-`` plus 43 random URL-safe characters (the SDK refuses keys without the prefix).
Only its SHA-256 is stored: the key is 256 bits of randomness, so a plain hash cannot be
brute-forced and needs no salt or slow KDF. Keys come from three places:

- ``hosted-tinker keys create`` writes them to the data dir's database (the tenant is the key's
  id, so revoking and re-creating gives a new tenant);
- ``--api-keys-file`` (one key per line) and ``$HOSTED_TINKER_API_KEYS`` (comma-separated), for
  keys managed elsewhere (the tenant is derived from the key's hash);
- ``--dev-any-key``: any ``tml-`` key is accepted and each distinct key is its own tenant. For
  development only; it is off unless asked for.

Once any of these is configured, every request needs a key. With none, the server is open and
everything belongs to one anonymous tenant (``OPEN``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from hosted_tinker.server.persistence.store import Store

PREFIX = "tml-"
OPEN = ""  # the tenant of every request when no key is configured
ENV_VAR = "HOSTED_TINKER_API_KEYS"


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(store: Store, name: str) -> tuple[str, str]:
    """A new key stored (as its hash) under ``name``; returns ``(key_id, key)``. The key is shown once."""
    key = new_key()
    key_id = f"key-{secrets.token_hex(6)}"
    store.add_api_key(key_id, name=name, sha256=key_hash(key), prefix=key[:10])
    return key_id, key


def read_keys_file(path: Path) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    keys = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    keys = [k for k in keys if k]
    bad = [k[:8] + "..." for k in keys if not k.startswith(PREFIX)]
    if bad:
        raise ValueError(f"{path}: keys must start with {PREFIX!r} (the SDK refuses others): {bad}")
    return keys


def env_keys() -> list[str]:
    keys = [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    if any(not k.startswith(PREFIX) for k in keys):
        raise ValueError(f"${ENV_VAR}: keys must start with {PREFIX!r}")
    return keys


class KeyRing:
    """Which tenant a request's key stands for. Stored keys are looked up per request, so a
    ``keys revoke`` (from another process, too) takes effect at once."""

    def __init__(self, store: Store, static_keys: Iterable[str] = (), allow_any: bool = False) -> None:
        self.store = store
        self._static = {key_hash(k): f"static-{key_hash(k)[:16]}" for k in static_keys}
        self.allow_any = allow_any
        self._required = bool(self._static) or allow_any

    @property
    def required(self) -> bool:
        """Whether requests need a key. Once true it stays true: a key created while the server
        runs closes it at once."""
        if not self._required and self.store.has_api_keys():
            self._required = True
        return self._required

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of ``key``, or None if the key is not valid here."""
        if not self.required:
            return OPEN
        if not key or not key.startswith(PREFIX):
            return None
        return self.tenant_of_digest(key_hash(key))

    def tenant_of_digest(self, digest: str) -> str | None:
        """The tenant of the key whose SHA-256 is ``digest`` (what a console cookie holds: a
        revoked key's cookies stop working at once), or None."""
        if not self.required:
            return OPEN
        if (tenant := self._static.get(digest)) is not None:
            return tenant
        if (key_id := self.store.api_key_id(digest)) is not None:
            return key_id
        return f"dev-{digest[:16]}" if self.allow_any else None

    def still_valid(self, tenant: str) -> bool:
        """Whether the key ``tenant`` stands for is still accepted here: what was made for a key
        (a download link) is checked again when used, so that revoking the key ends it."""
        if not self.required:
            return tenant == OPEN
        if tenant in self._static.values():
            return True
        if tenant.startswith("dev-"):
            return self.allow_any
        return self.store.api_key_valid(tenant)

    def describe(self) -> dict:
        """For /healthz: how requests are authenticated (never the keys)."""
        if self.allow_any:
            mode = "dev-any-key"
        else:
            mode = "api-keys" if self.required else "open"
        return {"mode": mode}
