"""``cas ui`` in a real browser: headless Chromium (Debian's) driven by Playwright.

One store for the module (two runs with history, a gate, a pool, a stored policy, markup in
metadata and a planted ref key), one server, one browser. Each page is loaded as a person would,
with the console watched for errors, and screenshotted into ``build/ui-screenshots`` (or
``$CAS_UI_SCREENSHOTS``) for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.ui.server import UIServer
from tests import ui_store
from tests.prerequisites import missing, require_module

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = Path(os.environ.get("CAS_UI_SCREENSHOTS", ROOT / "build" / "ui-screenshots"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
PAGES = {
    "runs": "/",
    "run": "/run?name=runs/alpha",
    "checkpoint": "/checkpoint?ref=runs/alpha/latest",
    "storage": "/storage",
    "retention": "/retention",
    "pools": "/pools",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ui") / "store"
    ui_store.build(path).close()
    (path / "refs" / f"runs%2Falpha%2F{ui_store.HOSTILE_KEY}").write_bytes(b"not a ref record")
    return path


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[UIServer]:
    repo = cas.open(str(store), readonly=True)
    ui = UIServer(repo, label=str(store))
    ui.start()
    ui.warm()
    yield ui
    ui.shutdown()
    repo.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = require_module("playwright.sync_api", "pip install playwright")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: UIServer) -> Iterator[Any]:
    """A fresh browser context that has opened the printed URL (so it holds the cookie), with
    every console error, uncaught exception and dialog recorded in ``page.problems``."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    problems: list[str] = []

    def on_console(message: Any) -> None:
        if message.type == "error":
            problems.append(f"console error: {message.text}")

    def on_dialog(dialog: Any) -> None:  # an alert() from markup that was not escaped
        problems.append(f"dialog: {dialog.message}")
        dialog.dismiss()

    tab.on("console", on_console)
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.on("dialog", on_dialog)
    tab.problems = problems
    tab.goto(server.url)
    yield tab
    context.close()


def base(server: UIServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def fetch(server: UIServer, path: str, **headers: str) -> tuple[int, bytes]:
    request = urllib.request.Request(base(server) + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def as_json(server: UIServer, path: str) -> Any:
    status, body = fetch(
        server, path, Accept="application/json", Authorization=f"token {server.token}"
    )
    assert status == 200, body
    return json.loads(body)


def cas_json(store: Path, *args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), *args, "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout)


def cells(page: Any, selector: str) -> list[list[str]]:
    rows = page.locator(f"{selector} tbody tr")
    return [rows.nth(i).locator("td").all_inner_texts() for i in range(rows.count())]


def test_every_page_loads_in_a_browser_without_a_console_error(page: Any, server: UIServer) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name, path in PAGES.items():
        page.goto(base(server) + path)
        assert page.locator("main h1").count() == 1, name
        assert "token" not in page.url  # the cookie carries it after the first visit
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    assert page.problems == []


def test_runs_page_lists_both_runs_with_their_state(page: Any, server: UIServer) -> None:
    rows = {r[0]: r for r in cells(page, "table.runs")}
    assert set(rows) == set(ui_store.RUNS)
    assert rows["runs/alpha"][1] == "running"
    assert rows["runs/beta"][1] == "completed"
    assert rows["runs/alpha"][2] == str(ui_store.STEPS)
    assert rows["runs/beta"][-1] == "same"  # the remote tier's latest is the local one
    assert rows["runs/alpha"][-1] == "absent"
    assert "Remote tiers: archive" in page.inner_text("main")


def test_run_page_draws_the_loss_curve_with_a_marker_per_checkpoint(
    page: Any, server: UIServer, store: Path
) -> None:
    page.goto(base(server) + "/run?name=runs/alpha")
    curve = page.locator('svg.chart polyline[data-series="loss"]')
    assert curve.count() == 1
    points = curve.get_attribute("points").split()
    assert len(points) == ui_store.STEPS  # one record a step
    saves = [e for e in as_json(server, "/run?name=runs/alpha")["events"] if e["event"] == "save"]
    assert len(saves) == ui_store.STEPS // ui_store.EVERY
    loss_chart = page.locator('svg.chart:has(polyline[data-series="loss"])')
    assert loss_chart.locator("circle.ckpt").count() == len(saves)
    assert loss_chart.locator("circle.ckpt.best").count() == 1  # latest is also best and gate
    labels = loss_chart.locator("circle.ckpt title").all_text_contents()
    assert any("latest" in t and "gate" in t for t in labels)
    assert page.problems == []


def test_retention_page_rows_match_forget_dry_run(page: Any, server: UIServer, store: Path) -> None:
    plan = cas_json(store, "forget", "--dry-run")["plan"]
    expected = {d["ref"]: "forget" for d in plan["drop"]}
    expected.update({d["ref"]: "protected" if d["protected"] else "kept" for d in plan["keep"]})
    page.goto(base(server) + "/retention")
    shown = {row[1]: row[2] for row in cells(page, "table.plan")}
    assert shown == expected
    assert "forget" in shown.values() and "kept" in shown.values()
    assert page.problems == []


def test_storage_page_bytes_match_du(page: Any, server: UIServer, store: Path) -> None:
    du = cas_json(store, "du")
    data = as_json(server, "/storage")
    assert data["referenced_bytes"] == du["stored_bytes"]
    from cas.units import format_size

    page.goto(base(server) + "/storage")
    assert f"{format_size(du['stored_bytes'])} referenced" in page.inner_text("main")
    per_run = {u["group"]: u for u in data["runs"]}
    for run in ui_store.RUNS:
        alone = cas_json(store, "du", f"{run}/")
        assert per_run[run]["stored_bytes"] == alone["stored_bytes"]
        assert per_run[run]["exclusive_bytes"] == alone["exclusive_bytes"]
    assert page.problems == []


def test_markup_in_metadata_and_ref_keys_renders_as_text(page: Any, server: UIServer) -> None:
    for path in ("/", "/run?name=runs/alpha", "/checkpoint?ref=runs/alpha/phase1/marked"):
        page.goto(base(server) + path)
        assert page.locator("main script, main img").count() == 0
    page.goto(base(server) + "/run?name=runs/alpha")
    assert ui_store.HOSTILE_KEY in page.inner_text("main")  # the planted key, named as damaged
    page.goto(base(server) + "/")
    assert ui_store.HOSTILE_META in page.inner_text("main")
    assert page.problems == []  # no alert() dialog, no error


def test_a_request_without_the_token_is_refused(server: UIServer) -> None:
    for path in PAGES.values():
        assert fetch(server, path)[0] == 403
    assert fetch(server, "/?token=wrong")[0] == 403
    assert fetch(server, "/", Cookie="cas_ui_token=wrong")[0] == 403
    assert fetch(server, "/storage", Authorization=f"token {server.token}")[0] == 200
    rebound = fetch(server, "/", Authorization=f"token {server.token}", Host="evil.example:80")
    assert rebound[0] == 403
    request = urllib.request.Request(
        base(server) + "/",
        data=b"",
        method="POST",
        headers={"Authorization": f"token {server.token}"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 405


def test_every_view_also_answers_json(server: UIServer) -> None:
    assert {r["run"] for r in as_json(server, "/")["runs"]} == set(ui_store.RUNS)
    assert "loss" in as_json(server, "/run?name=runs/alpha")["series"]
    assert as_json(server, "/checkpoint?ref=runs/alpha/latest")["tensors"]
    assert as_json(server, "/retention")["policy"] is not None
    pools = as_json(server, "/pools")["pools"]
    assert pools[0]["entries"][0]["anchor"] is True
    status, body = fetch(server, "/run?name=runs/nope", Accept="application/json",
                         Authorization=f"token {server.token}")  # fmt: skip
    assert status == 404 and "error" in json.loads(body)


def test_cas_ui_prints_a_url_with_a_token_and_serves_it(store: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "cas", "--store", str(store), "ui", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", line)
        assert url is not None, line
        browser_like = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with browser_like.open(url.group(0), timeout=30) as answer:
            assert answer.status == 200
            assert b"runs/alpha" in answer.read()
        port = url.group(0).split(":")[2].split("/")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30)
        assert refused.value.code == 403
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_cas_ui_json_prints_its_address_for_a_script(store: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "cas", "--store", str(store), "ui", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        assert started["url"].endswith(f"?token={started['token']}")
        status, _ = fetch_from(started["port"], "/storage", started["token"])
        assert status == 200
    finally:
        process.terminate()
        process.wait(timeout=30)


def fetch_from(port: int, path: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"token {token}"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, answer.read()
