"""The web console (``server.console``): its cookie and CSRF tokens; the pages over plain HTTP
(sign-in, isolation, CSRF, operators); and a real browser (Playwright driving Debian's headless
Chromium) signing in, seeing a run the SDK trained in the same test with one chart point per
step, deleting a checkpoint that the SDK then no longer lists, and signing out.

``HOSTED_TINKER_SCREENSHOTS=docs`` makes the browser test save each page's screenshot there."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, start_server
from tests.support.tenants import cli

ROOT = Path(__file__).resolve().parents[2]


# ---- a keyed server, two tenants, one of them an operator ------------------------------------


def datum(k: int) -> types.Datum:
    tokens = [(k * 5 + i) % 300 + 10 for i in range(17)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16},
    )


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """A server with keys for alice (an operator) and bob; alice's run of three steps with two
    checkpoints, bob's run of one step."""
    data = tmp_path_factory.mktemp("console")
    alice = cli("keys", "create", "--data-dir", str(data), "--name", "alice")
    bob = cli("keys", "create", "--data-dir", str(data), "--name", "bob")
    ids = {line.split()[-1]: line.split()[0] for line in cli("keys", "list", "--data-dir", str(data)).splitlines()}
    srv = start_server(data, "--model", str(tiny_model_dir), "--console-operator", ids["alice"])
    try:
        runs, losses = {}, []
        for who, key, steps in (("alice", alice, 3), ("bob", bob, 1)):
            with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
                tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
                for step in range(steps):
                    out = tc.forward_backward([datum(step)], "cross_entropy").result()
                    tc.optim_step(types.AdamParams(learning_rate=1e-3 * (step + 1))).result()
                    if who == "alice":
                        losses.append(out.metrics["loss:sum"])
                if who == "alice":
                    tc.save_state("first").result()
                    tc.save_state("second").result()
                    tc.save_weights_and_get_sampling_client()
                runs[who] = tc.get_info().model_id
        yield {"url": srv.base_url, "keys": {"alice": alice, "bob": bob}, "runs": runs, "losses": losses, "data": data}
    finally:
        srv.stop()


@contextmanager
def signed_in(base_url: str, key: str) -> Iterator[httpx.Client]:
    """An HTTP client that signed in through the form, as a browser does."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        page = client.get("/console/signin")
        nonce = re.search(r'name="nonce" value="([^"]+)"', page.text).group(1)
        answer = client.post("/console/signin", data={"key": key, "nonce": nonce, "next": "/console/runs"})
        assert answer.status_code == 303 and answer.headers["location"] == "/console/runs"
        yield client


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_signing_in_sets_a_strict_http_only_cookie_and_a_bad_key_is_refused(console):
    with httpx.Client(base_url=console["url"], timeout=30) as anonymous:
        assert anonymous.get("/console/runs").headers["location"].startswith("/console/signin?next=")
        assert anonymous.get(f"/console/api/runs/{console['runs']['alice']}/metrics").status_code == 401
        page = anonymous.get("/console/signin")
        nonce = re.search(r'name="nonce" value="([^"]+)"', page.text).group(1)
        bad = anonymous.post("/console/signin", data={"key": "tml-not-a-key", "nonce": nonce})
        assert bad.status_code == 401 and "not valid" in bad.text
        forged = httpx.post(f"{console['url']}/console/signin", data={"key": console["keys"]["alice"], "nonce": "x"})
        assert forged.status_code == 403  # no nonce cookie: a form posted from another site
        # Non-ASCII where an HMAC is compared, an oversized or field-stuffed form: 4xx, never 500.
        weird = httpx.get(f"{console['url']}/console/runs", headers={"Cookie": b"ht_console=a.b.\xc3\xa9"})
        assert weird.status_code == 303
        anonymous.cookies.set("ht_console_signin", nonce, path="/console")
        assert anonymous.post("/console/signin", data={"nonce": "\u00e9", "key": "x"}).status_code == 403
        assert anonymous.post("/console/signin", content=b"a=&" * 4000).status_code == 413
        assert anonymous.post("/console/signin", content=b"a=&" * 20).status_code == 400
    with signed_in(console["url"], console["keys"]["alice"]) as client:
        cookie = next(c for c in client.cookies.jar if c.name == "ht_console")
        assert cookie.path == "/console" and cookie.has_nonstandard_attr("HttpOnly")
        assert cookie.get_nonstandard_attr("SameSite", "").lower() == "lax"
        assert console["keys"]["alice"] not in cookie.value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_tenant_sees_its_own_runs_only(console):
    alice_run, bob_run = console["runs"]["alice"], console["runs"]["bob"]
    with signed_in(console["url"], console["keys"]["bob"]) as bob:
        runs = bob.get("/console/runs").text
        assert bob_run in runs and alice_run not in runs
        assert bob.get(f"/console/runs/{alice_run}").status_code == 404
        assert bob.get(f"/console/runs/{bob_run}9").status_code == 404  # a made-up id in bob's session
        assert bob.get(f"/console/api/runs/{bob_run}9/metrics").status_code == 404
        assert bob.get(f"/console/api/runs/{alice_run}/metrics").status_code == 404
        assert bob.get("/console/server").status_code == 403  # not an operator
        mine = bob.get(f"/console/api/runs/{bob_run}/metrics").json()
        assert [s["step"] for s in mine["steps"]] == [0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_changes_need_this_session_s_csrf_token_and_this_site_s_origin(console):
    run = console["runs"]["alice"]
    with signed_in(console["url"], console["keys"]["alice"]) as alice:
        token = csrf_of(alice.get(f"/console/runs/{run}").text)
        publish = f"/console/runs/{run}/checkpoints/weights/second/publish"
        assert alice.post(publish, data={}).status_code == 403
        assert alice.post(publish, data={"csrf_token": "0" * 64}).status_code == 403
        evil = {"Sec-Fetch-Site": "cross-site"}  # what a browser says of another site's form
        assert alice.post(publish, data={"csrf_token": token}, headers=evil).status_code == 403
        huge = {"csrf_token": token, "pad": "x" * 10_000}
        assert alice.post(publish, data=huge).status_code == 413
        with signed_in(console["url"], console["keys"]["bob"]) as bob:  # bob's token, alice's run
            bob_token = csrf_of(bob.get("/console/runs").text)
            assert bob.post(publish, data={"csrf_token": bob_token}).status_code == 404
        assert alice.post(publish, data={"csrf_token": token}).status_code == 303
        listed = alice.get(f"/api/v1/training_runs/{run}/checkpoints", headers={"X-API-Key": console["keys"]["alice"]})
        second = next(c for c in listed.json()["checkpoints"] if c["checkpoint_id"] == "weights/second")
        assert second["public"] is True
        unpublish = publish.replace("/publish", "/unpublish")
        assert alice.post(unpublish, data={"csrf_token": token}).status_code == 303


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_server_page_shows_workers_keys_and_errors_to_an_operator(console):
    with signed_in(console["url"], console["keys"]["alice"]) as alice:
        alice.get("/console/runs/no-such-run")  # an error of this test's, for the page to show
        page = alice.get("/console/server")
        assert page.status_code == 200
        for shown in ("Workers", "rss", "Queue", "Inference", "alice", "bob", "Recent errors"):
            assert shown in page.text
        metrics = alice.get("/metrics", headers={"X-API-Key": console["keys"]["alice"]}).text
        assert re.search(r'hosted_tinker_rank_memory_bytes\{device="cpu",kind="rss",rank="0"\} [1-9]', metrics)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_signing_out_revokes_the_cookie_on_the_server(console):
    """Signing out only asked the browser to forget its cookie: a copy of it (a stolen one)
    kept working for its 12 hours."""
    with signed_in(console["url"], console["keys"]["bob"]) as bob:
        kept = bob.cookies["ht_console"]
        token = csrf_of(bob.get("/console/runs").text)
        assert bob.post("/console/signout", data={"csrf_token": token}).headers["location"] == "/console/signin"
    with httpx.Client(base_url=console["url"], timeout=30, cookies={"ht_console": kept}) as copy:
        assert copy.get("/console/runs").headers["location"].startswith("/console/signin")
        assert copy.get(f"/console/api/runs/{console['runs']['bob']}/metrics").status_code == 401
    with signed_in(console["url"], console["keys"]["bob"]) as again:  # signing in again works at once
        assert again.get("/console/runs").status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_revoked_key_s_cookie_stops_working(tmp_path: Path, tiny_model_dir: Path):
    key = cli("keys", "create", "--data-dir", str(tmp_path), "--name", "carol")
    key_id = cli("keys", "list", "--data-dir", str(tmp_path)).split()[0]
    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        with signed_in(srv.base_url, key) as carol:
            assert carol.get("/console/runs").status_code == 200
            cli("keys", "revoke", "--data-dir", str(tmp_path), key_id)
            assert carol.get("/console/runs").headers["location"].startswith("/console/signin")
    finally:
        srv.stop()


# ---- a real browser ----------------------------------------------------------------------------


def chromium() -> str | None:
    """Debian's Chromium (``apt-get install chromium``; scripts/install.sh --test), or $HOSTED_TINKER_CHROMIUM."""
    for candidate in (os.environ.get("HOSTED_TINKER_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.fixture
def browser():
    executable = chromium()
    if executable is None:
        if os.environ.get("HOSTED_TINKER_REQUIRE_CHROMIUM"):
            pytest.fail("Chromium is required here (HOSTED_TINKER_REQUIRE_CHROMIUM) but not installed")
        pytest.skip("Chromium is not installed (apt-get install chromium; scripts/install.sh --test does)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_in_a_browser_a_run_its_chart_a_deleted_checkpoint_and_signing_out(console, browser, tmp_path: Path):
    base, run, other = console["url"], console["runs"]["alice"], console["runs"]["bob"]
    shots = Path(os.environ["HOSTED_TINKER_SCREENSHOTS"]) if os.environ.get("HOSTED_TINKER_SCREENSHOTS") else tmp_path
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmation before a delete

    page.goto(f"{base}/console")
    assert page.url.startswith(f"{base}/console/signin")
    page.screenshot(path=str(shots / "console-signin.png"))
    page.fill("#key", console["keys"]["alice"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/runs")
    assert page.locator(f"text={run}").count() == 1
    assert page.locator(f"text={other}").count() == 0  # bob's run is not alice's to see
    page.screenshot(path=str(shots / "console-runs.png"))

    page.click(f"text={run}")
    page.wait_for_url(re.compile(r".*/console/runs/[^/]+$"))
    assert unquote(page.url.rsplit("/", 1)[1]) == run
    chart = page.locator('figure.chart[data-series="loss:sum"]')
    chart.wait_for()
    page.wait_for_function(
        "document.querySelector('figure.chart[data-series=\"loss:sum\"]').dataset.points === '3'", timeout=15_000
    )
    assert chart.locator("canvas").count() >= 1
    assert page.locator("#step-count").inner_text() == "3"
    assert page.locator('figure.chart[data-series="learning_rate"]').get_attribute("data-points") == "3"
    page.screenshot(path=str(shots / "console-run.png"), full_page=True)

    row = page.locator('tr[data-checkpoint="weights/first"]')
    assert row.count() == 1
    row.locator("button.danger").click()
    page.wait_for_load_state()
    assert page.locator('tr[data-checkpoint="weights/first"]').count() == 0
    assert page.locator('tr[data-checkpoint="weights/second"]').count() == 1
    listed = tinker.RestClient(base_url=base, api_key=console["keys"]["alice"]).list_checkpoints(run).result()
    ids = [c.checkpoint_id for c in listed.checkpoints]
    assert "weights/first" not in ids and "weights/second" in ids

    assert page.goto(f"{base}/console/runs/{other}").status == 404
    assert page.goto(f"{base}/console/server").status == 200
    page.screenshot(path=str(shots / "console-server.png"), full_page=True)

    page.click("text=Sign out")
    page.wait_for_url(re.compile(r".*/console/signin.*"))
    page.goto(f"{base}/console/runs")
    assert "/console/signin" in page.url
    deadline = time.monotonic() + 5  # the cookie is gone from the browser too
    while any(c["name"] == "ht_console" for c in page.context.cookies()):
        assert time.monotonic() < deadline


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_open_server_s_console_needs_no_key_until_one_is_created(tmp_path: Path, tiny_model_dir: Path):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        with signed_in(srv.base_url, "") as anyone:
            assert anyone.get("/console/runs").status_code == 200
            assert anyone.get("/console/server").status_code == 200  # everyone is the operator
            cli("keys", "create", "--data-dir", str(tmp_path), "--name", "first")
            assert anyone.get("/console/runs").headers["location"].startswith("/console/signin")
    finally:
        srv.stop()
