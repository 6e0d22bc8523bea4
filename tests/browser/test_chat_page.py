"""The web chat page in a real browser (Debian's chromium driven by Playwright) against the real mesh: type a
message, see the reply stream in, stop it mid-reply, reload and see the history with the stopped reply,
regenerate it (and stop that), delete the conversation. The sim engine is slowed so a reply streams for many seconds."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatmesh.mesh.up import Mesh
from tests.conftest import need

CHROMIUM = "/usr/bin/chromium"


def _browser_mesh(tmp: Path, **extra: str) -> Iterator[Mesh]:
    """A real mesh for a browser test (skipped without Debian's chromium), stopped after the module."""
    need(shutil.which("chromium") is not None or Path(CHROMIUM).exists(), "chromium (apt-get install chromium)")
    from tests.e2e.conftest import start_mesh  # the lead's real-mesh fixture module

    mesh = start_mesh(tmp, **extra)
    try:
        yield mesh
    finally:
        mesh.stop()
pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from _browser_mesh(tmp_path_factory.mktemp("browser-mesh"), CHATMESH_SIM_STEP_MS="150",
                             CHATMESH_MAX_REPLY_TOKENS="400")


@pytest.mark.timeout(240)
def test_type_stream_stop_reload_delete(slow_mesh: Mesh) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(slow_mesh.gateway_url)
            expect(page.locator("#whoami")).to_contain_text("signed in as")
            expect(page.locator("#login")).to_be_hidden()  # a signed-in user is not shown the sign-in form

            page.fill("#input", "Please tell me a long story about routing.")
            page.click("#send")
            reply = page.locator(".message.assistant").last
            # The reply streams in: some text is shown while the turn is still running (stop is enabled).
            page.wait_for_function(
                "() => { const m = [...document.querySelectorAll('.message.assistant')].pop();"
                " return m && m.dataset.text.length > 10; }")
            expect(page.locator("#stop")).to_be_enabled()
            page.click("#stop")
            expect(reply).to_have_attribute("data-status", "stopped")
            stopped_text = reply.get_attribute("data-text") or ""
            assert 10 < len(stopped_text)
            expect(page.locator("#send")).to_be_enabled()
            conversation = page.evaluate("() => location.hash.slice(1)")
            assert len(conversation) == 36

            page.reload()
            expect(page.locator(".message.user")).to_have_text("Please tell me a long story about routing.")
            history = page.locator(".message.assistant")
            expect(history).to_have_count(1)
            expect(history).to_have_attribute("data-status", "stopped")
            assert (history.get_attribute("data-text") or "").startswith(stopped_text[:10])

            # Regenerate the stopped reply: a new reply streams in its place; stop it too.
            expect(page.locator("#regenerate")).to_be_enabled()
            page.click("#regenerate")
            page.wait_for_function(
                "() => { const m = [...document.querySelectorAll('.message.assistant')].pop();"
                " return m && m.dataset.status === 'streaming' && m.dataset.text.length > 10; }")
            page.click("#stop")
            expect(page.locator(".message.assistant").last).to_have_attribute("data-status", "stopped")

            item = page.locator(f'#conversations li[data-id="{conversation}"]')
            expect(item).to_have_count(1)
            item.locator("button.delete").click()
            expect(item).to_have_count(0)
            expect(page.locator(".message")).to_have_count(0)
            gone = page.request.get(f"{slow_mesh.gateway_url}/v1/conversations/{conversation}")
            assert gone.status == 404
        finally:
            browser.close()


@pytest.fixture(scope="module")
def quick_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from _browser_mesh(tmp_path_factory.mktemp("browser-quick"), CHATMESH_MAX_REPLY_TOKENS="24")


@pytest.mark.timeout(180)
def test_each_reply_shows_its_ttft_prompt_and_cached_tokens_and_replica(quick_mesh: Mesh) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(quick_mesh.gateway_url)
            expect(page.locator("#whoami")).to_contain_text("signed in as")
            figures = page.locator(".turn-figures")
            for n, text in enumerate(["What is a prefix cache?", "And why does the second turn hit it?"], 1):
                page.fill("#input", text)
                page.click("#send")
                expect(figures).to_have_count(n)
                expect(page.locator("#send")).to_be_enabled()
            first, second = figures.nth(0), figures.nth(1)
            prompt = [int(f.get_attribute("data-prompt-tokens") or 0) for f in (first, second)]
            cached = [int(f.get_attribute("data-cached-tokens") or 0) for f in (first, second)]
            # the second turn's prompt starts with the whole first turn, which the engine still holds
            assert prompt[1] > prompt[0] > 0
            assert cached[1] > cached[0] and cached[1] >= prompt[0] // 2
            assert float(second.get_attribute("data-ttft-ms") or "nan") > 0
            assert second.get_attribute("data-replica") == "engine-0"
            expect(second).to_contain_text(f"{prompt[1]} prompt tokens, {cached[1]} from cache")
            expect(second).to_contain_text("TTFT ")
            expect(second).to_contain_text("engine-0")
        finally:
            browser.close()
