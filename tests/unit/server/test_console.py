"""The unit tests of what tests/e2e/test_console.py tests end to end (no server here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hosted_tinker.server.console.routes import _next
from hosted_tinker.server.console.signin import ConsoleSignIn
from hosted_tinker.server.console.views import recent_errors
from hosted_tinker.server.keys import key_hash

pytestmark = pytest.mark.fast


def test_a_cookie_stands_for_its_key_until_it_expires_and_cannot_be_forged():
    signin = ConsoleSignIn(b"s" * 32, lifetime_s=60)
    digest = key_hash("tml-alice")
    cookie = signin.cookie(digest, now=1000.0)
    assert digest in cookie and "tml-alice" not in cookie  # the key's hash, never the key
    assert signin.verify(cookie, now=1059.0).digest == digest
    assert signin.verify(cookie, now=1060.0) is None  # expired
    other = key_hash("tml-mallory")
    assert signin.verify(cookie.replace(digest, other), now=1001.0) is None  # another key's digest
    body, _, mac = cookie.rpartition(".")
    assert signin.verify(body.replace(".1060", ".9999") + "." + mac, now=1001.0) is None  # a longer life
    assert ConsoleSignIn(b"t" * 32).verify(cookie, now=1001.0) is None  # another server's secret
    for garbage in (None, "", "a.b", "a.b.c.d", f"{digest}.soon.{mac}"):
        assert signin.verify(garbage, now=1001.0) is None


def test_csrf_tokens_belong_to_their_cookie():
    signin = ConsoleSignIn(b"s" * 32)
    a, b = signin.cookie(key_hash("tml-a")), signin.cookie(key_hash("tml-b"))
    assert signin.csrf_ok(a, signin.csrf_token(a))
    assert not signin.csrf_ok(a, signin.csrf_token(b))
    assert not signin.csrf_ok(a, None) and not signin.csrf_ok(None, signin.csrf_token(a))
    assert signin.csrf_token(a) not in a  # not derivable from what a page can see


@pytest.mark.parametrize(
    ("target", "goes_to"),
    [
        ("/console/runs/abc", "/console/runs/abc"),
        ("/console/server", "/console/server"),
        ("https://evil.example/", "/console/runs"),
        ("//evil.example/console/", "/console/runs"),
        ("/console\\..\\x", "/console/runs"),
        ("/api/v1/x", "/console/runs"),
        (None, "/console/runs"),
    ],
)
def test_after_signing_in_only_console_pages_are_followed(target: str | None, goes_to: str):
    assert _next(target) == goes_to


def test_recent_errors_are_the_newest_failed_requests(tmp_path: Path):
    log = tmp_path / "requests.jsonl"
    lines = [{"time": float(i), "status": 200 if i % 3 else 404, "path": f"/p{i}"} for i in range(30)]
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    errors = recent_errors(log, limit=4)
    assert [e["path"] for e in errors] == ["/p27", "/p24", "/p21", "/p18"]
    assert recent_errors(tmp_path / "absent.jsonl") == []
