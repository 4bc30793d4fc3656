"""The unit tests of what tests/e2e/test_request_log.py tests end to end (no server here)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.support.logs import lines

pytestmark = pytest.mark.fast


def test_the_log_rotates_by_size_and_never_rotates_what_is_not_a_file(tmp_path: Path, monkeypatch):
    from hosted_tinker.server.api import request_log

    monkeypatch.setattr(request_log, "ROTATE_BYTES", 1000)
    target = tmp_path / "requests.jsonl"
    logger = request_log.open_request_log(str(target))
    for i in range(50):  # 50 lines of ~47 bytes, about 20 to a file
        logger.info(json.dumps({"i": i, "pad": "x" * 30}))
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"]
    assert all(f.stat().st_size < 1000 for f in files)
    written = [json.loads(line)["i"] for f in reversed(files) for line in f.read_text().splitlines()]
    assert written == list(range(50))  # nothing lost, in order

    logger = request_log.open_request_log("/dev/null")  # not a regular file: written, not renamed
    for i in range(60):
        logger.info(json.dumps({"i": i, "pad": "x" * 30}))
    assert Path("/dev/null").is_char_device()
    request_log.open_request_log(str(tmp_path / "again.jsonl"))  # closes the /dev/null handler


def test_lines_without_a_key_are_limited_and_counted_in_a_summary(tmp_path: Path):
    """A flood of keyless requests is a few lines and a count, however long it lasts; every keyed
    line is written."""
    from hosted_tinker.server.api import request_log

    now = [1000.0]
    target = tmp_path / "requests.jsonl"
    log = request_log.RequestLines(request_log.open_request_log(str(target)), per_s=2.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] += 0.001  # 10 s at 1,000 requests per second
        log.write({"method": "GET", "route": None, "path": f"/x{i}", "status": 404, "client": f"10.0.0.{i % 3}"})
        if i % 1000 == 0:
            log.write({"key_id": "key-a", "method": "GET", "route": "/api/v1/training_runs", "status": 200})
        if i % 500 == 0:  # a key past its rate: refused, and limited too
            log.write({"key_id": "key-b", "method": "POST", "route": "/api/v1/forward", "status": 429})
    assert not any("suppressed" in x for x in lines(target))  # within the minute: not yet
    now[0] += request_log.SUMMARY_EVERY_S
    log.write({"method": "GET", "route": None, "path": "/late", "status": 404, "client": "10.0.0.9"})
    written = lines(target)
    assert len([x for x in written if x.get("key_id") == "key-a"]) == 10  # never limited
    full = [x for x in written if "suppressed" not in x and x.get("key_id") != "key-a"]
    assert len(full) <= 2.0 * request_log.BURST_S + 2.0 * 70 + 1  # a burst, then per_s
    [summary] = [x for x in written if "suppressed" in x]
    assert summary["suppressed"] + len(full) == 10_000 + 20 + 1
    counted = {(g["status"], g.get("client"), g.get("key_id")): g["count"] for g in summary["groups"]}
    assert (
        sum(n for (status, _, _), n in counted.items() if status == 404) + sum(1 for x in full if x["status"] == 404)
        == 10_000 + 1
    )
    assert {client for status, client, _ in counted if status == 404} == {"10.0.0.0", "10.0.0.1", "10.0.0.2"}
    assert {key for status, _, key in counted if status == 429} == {"key-b"}  # a key's refusals name it
    for _ in range(1000):  # in the same instant: past the burst
        log.write({"method": "GET", "route": None, "path": "/again", "status": 404, "client": "10.0.0.9"})
    log.flush()  # at shutdown: what was held back since the last summary
    last = lines(target)[-1]
    assert last["suppressed"] + len(lines(target)) - len(written) - 1 == 1000


def test_secrets_in_a_query_string_or_a_link_are_never_logged():
    from hosted_tinker.server.api.request_log import SecretsRedacted, redacted

    assert redacted("/api/v1/x?api_key=tml-abc&limit=3&Token=t0k") == "/api/v1/x?api_key=...&limit=3&Token=..."
    assert redacted("/v1/models?key=k&sig=s&signature=s2&x") == "/v1/models?key=...&sig=...&signature=...&x"
    assert redacted("/api/v1/files/7b22/0123abcd/adapter.bin") == "/api/v1/files/7b22/.../adapter.bin"
    assert redacted("/api/v1/traces/7b22/0123abcd/s.json?x=1") == "/api/v1/traces/7b22/.../s.json?x=1"
    assert redacted("/healthz") == "/healthz"
    # other spellings (a review found these written as they came)
    for query in ("api%5Fkey=s", "x-api-key=s", "authorization=Bearer%20s", "a=1;api_key=s", "api_key[]=s"):
        assert "=s" not in redacted(f"/v1/models?{query}").replace("=...", ""), query
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/api/v1/x?api_key=tml-secret", "1.1", 401), None,
    )  # fmt: skip
    assert SecretsRedacted().filter(record) and "tml-secret" not in record.getMessage()
