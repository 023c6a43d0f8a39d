"""The cache explorer page in a real browser: Debian's headless chromium driven by playwright (pointed at the system
browser; playwright downloads nothing), against a live server on the tiny model with two tenants.

Skips only when no chromium is installed (`apt-get install chromium`) or playwright is missing. The screenshot goes to
the test's tmp folder, and also to $DASHBOARD_SCREENSHOT when set (that is how docs/dashboard.png is made)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_checks import engine_left_at_rest, wait_idle
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

CHROMIUM = os.environ.get("RADIXSERVE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
)
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)")

ALICE, BOB = "alice-key", "bob-key"
try:  # keys with roles (issue 21): `--api-key` entries are admins unless they say role=user
    import radixserve.server.tenants  # noqa: F401

    KEYS = f"{ALICE} role=user,{BOB} role=user"
except ImportError:  # before roles: every key is a tenant
    KEYS = f"{ALICE},{BOB}"
SECRET = "alpha secret plan"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    with (
        engine_left_at_rest(tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=8192) as eng,
        BackgroundServer(build_app(eng, api_key=KEYS)) as srv,
    ):
        run_workload(srv, eng)
        yield srv


def run_workload(srv: BackgroundServer, eng: Engine) -> None:
    """Alice: a three-turn conversation and two side questions on the same system prompt; Bob: one prompt."""
    model = eng.model_info()["model_name"]
    body = {"model": model, "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {ALICE}"}) as a:
        msgs = [{"role": "system", "content": f"You help with the {SECRET} of the red fox."}]
        for q in ["What is the plan?", "And the next step?", "Who else knows?"]:
            msgs.append({"role": "user", "content": q})
            r = a.post("/v1/chat/completions", json={**body, "messages": msgs}).json()
            msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        for q in ["Tell me about gamma.", "Tell me about delta."]:
            a.post("/v1/chat/completions", json={**body, "messages": msgs[:1] + [{"role": "user", "content": q}]})
    with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {BOB}"}) as b:
        b.post("/v1/completions", json={**body, "prompt": "bob writes about zebras"})
    wait_idle(eng)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_page(browser: object, url: str, key: str, errors: list[str]) -> object:
    page = browser.new_page(viewport={"width": 1400, "height": 1100})  # type: ignore[attr-defined]
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(url + "/dashboard")
    page.wait_for_selector("#conn")
    page.fill("#apikey", key)
    page.click("#keyform button")
    page.wait_for_selector("#tree g.node[data-key]:not([data-key=''])")
    page.wait_for_selector("#conn.on")
    return page


def test_dashboard_in_a_browser(server: BackgroundServer, browser: object, tmp_path: Path) -> None:
    errors: list[str] = []
    page = open_page(browser, server.url, ALICE, errors)
    api_tree = httpx.get(server.url + "/cache/tree", headers={"Authorization": f"Bearer {ALICE}"}).json()
    shown = page.locator("#tree g.node[data-key]:not([data-key=''])")
    assert shown.count() == api_tree["shown_nodes"] >= 5, "every node of the workload's tree is drawn"
    labels = " ".join(
        page.locator("#tree g.node title").all_text_contents() + page.locator("#tree text").all_text_contents()
    )
    assert SECRET in labels and "hits" in labels

    # a click on the system prompt's node (shared by every turn: hit more than once) opens its details
    node = page.locator("#tree g.node", has_text=SECRET).first
    node.click()
    page.wait_for_selector("#nodetext")
    assert SECRET in page.inner_text("#nodetext")
    details = page.inner_text("#nodeinfo")
    for field in ("pages", "tokens", "hits", "last access", "lock", "children"):
        assert field in details
    assert page.locator("#details li").count() >= 2, "its children (the branches of the conversation) are listed"

    # the panels: pool occupancy, hit rate, requests, timelines (five requests of Alice's)
    assert "cached, evictable" in page.inner_text("#pool")
    assert "% of prompt tokens" in page.inner_text("#hitrate")
    page.wait_for_function("document.querySelectorAll('#timelines .tl').length >= 5")
    assert page.locator("#timelines rect.k-prefill").count() >= 5

    # zoom into the node (double-click), then back to the root
    node.dblclick()
    page.wait_for_function("document.querySelectorAll('#crumbs a').length == 2")
    page.click("#crumbs a >> nth=0")
    page.wait_for_function("document.querySelectorAll('#crumbs a').length == 1")

    # why did this miss: a prompt that shares the system prompt, then leaves the tree
    page.fill("#missprompt", f"<|im_start|>system\nYou help with the {SECRET} of the blue whale.")
    page.click("#missform button")
    page.wait_for_selector("#missexplain")
    assert "leaves the tree" in page.inner_text("#missexplain")

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["DASHBOARD_SCREENSHOT"])
    page.close()
    assert errors == [], errors


def test_a_tenant_sees_none_of_another_tenants_text(server: BackgroundServer, browser: object) -> None:
    errors: list[str] = []
    page = open_page(browser, server.url, BOB, errors)
    page.wait_for_function("document.querySelectorAll('#timelines .tl').length >= 1")
    everything = page.evaluate("document.documentElement.textContent")
    assert "zebras" in everything, "Bob sees his own prompt"
    assert SECRET not in everything and "red fox" not in everything, "Alice's text never reaches Bob's page"
    page.fill("#missprompt", f"<|im_start|>system\nYou help with the {SECRET} of the red fox.")
    page.click("#missform button")
    page.wait_for_selector("#missexplain")
    assert "nothing of this prompt is cached" in page.inner_text("#missexplain"), "Alice's prefix is not Bob's hit"
    page.close()
    assert errors == [], errors


def test_without_a_key_the_page_asks_for_one_and_errs_nowhere(server: BackgroundServer, browser: object) -> None:
    errors: list[str] = []
    page = browser.new_page()  # type: ignore[attr-defined]
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/dashboard")
    page.wait_for_function("document.getElementById('treeinfo').textContent.includes('API key')")
    assert page.locator("#tree g.node").count() == 0
    page.close()
    assert errors == []
