"""API keys and ownership in the store, without a server."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hosted_tinker.server.keys import OPEN, KeyRing, create_key, key_hash, read_keys_file
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.quotas import Limits, Quotas

pytestmark = pytest.mark.fast


def test_open_until_a_key_exists_and_closed_for_good_after(tmp_path: Path):
    store = Store.in_data_dir(tmp_path)
    ring = KeyRing(store)
    assert ring.required is False and ring.tenant_of(None) == OPEN and ring.tenant_of("tml-anything") == OPEN
    key_id, key = create_key(store, "alice")
    assert ring.required and ring.tenant_of(key) == key_id
    assert ring.tenant_of(None) is None and ring.tenant_of("tml-guess") is None and ring.tenant_of(key + "x") is None
    assert store.revoke_api_key("alice") == 1
    assert ring.tenant_of(key) is None
    assert KeyRing(store).required, "revoking the last key must not open the server"
    assert [k.key_id for k in store.list_api_keys()] == [key_id] and store.list_api_keys()[0].revoked_at


def test_only_the_hash_is_stored(tmp_path: Path):
    store = Store.in_data_dir(tmp_path)
    _, key = create_key(store, "bob")
    store.close()
    rows = sqlite3.connect(tmp_path / "hosted_tinker.sqlite").execute("SELECT * FROM api_keys").fetchall()
    assert key not in repr(rows) and key_hash(key) in repr(rows)


def test_static_and_dev_keys(tmp_path: Path):
    store = Store.in_data_dir(tmp_path)
    ring = KeyRing(store, ["tml-from-file"])
    assert ring.required and ring.tenant_of("tml-from-file").startswith("static-")
    assert ring.tenant_of("tml-other") is None
    dev = KeyRing(store, allow_any=True)
    one, two = dev.tenant_of("tml-one"), dev.tenant_of("tml-two")
    assert one and two and one != two and dev.tenant_of("tml-one") == one
    assert dev.tenant_of("sk-not-tinker") is None and dev.tenant_of(None) is None


def test_keys_file_skips_comments_and_refuses_other_prefixes(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("# ops team\ntml-aaa\n\ntml-bbb  # ci\n")
    assert read_keys_file(path) == ["tml-aaa", "tml-bbb"]
    path.write_text("sk-123\n")
    with pytest.raises(ValueError, match="tml-"):
        read_keys_file(path)


def test_a_data_dir_from_before_keys_gains_owners(tmp_path: Path):
    db = sqlite3.connect(tmp_path / "hosted_tinker.sqlite")
    db.execute(
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_at REAL NOT NULL, last_heartbeat REAL NOT NULL, "
        "status TEXT NOT NULL DEFAULT 'active', tags TEXT NOT NULL DEFAULT '[]', user_metadata TEXT NOT NULL "
        "DEFAULT '{}', project_id TEXT, display_name TEXT, sdk_version TEXT)"
    )
    db.execute("INSERT INTO sessions(session_id, created_at, last_heartbeat) VALUES ('sess-old', 0, 0)")
    db.commit()
    db.close()
    store = Store.in_data_dir(tmp_path)
    assert store.session_owner("sess-old") == OPEN  # an open server's data stays its own
    store.add_session(
        "sess-new", owner="key-1", tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
    )
    assert store.list_sessions("key-1", 10, 0) == ["sess-new"] and store.list_sessions(OPEN, 10, 0) == ["sess-old"]


def test_a_slow_rate_still_admits_a_request_now_and_then(tmp_path: Path):
    """requests_per_s below 0.1 makes a bucket of less than one request (BURST_S = 10 s): its
    first request, and one per 1/rate seconds, must still get in; each bucket (requests,
    heartbeats) on its own."""
    now = [0.0]
    quotas = Quotas(Store(tmp_path / "db.sqlite"), Limits(requests_per_s=0.05), 64, clock=lambda: now[0])
    assert quotas.admit("t") is None and quotas.admit("t", "heartbeats") is None
    assert quotas.admit("t") is not None  # the bucket is empty now
    now[0] = 20.0  # one request's worth at 0.05/s
    assert quotas.admit("t") is None and quotas.admit("t") is not None
