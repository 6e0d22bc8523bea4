"""The web chat page in a real browser (Debian's chromium driven by Playwright) against the real mesh: type a
message, see the reply stream in, stop it mid-reply, reload and see the history with the stopped reply,
regenerate it (and stop that), delete the conversation. The sim engine is slowed so a reply streams for many seconds."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from chatmesh.mesh.up import Mesh
from tests.conftest import need

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = "/usr/bin/chromium"
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default profile's model id


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


@contextlib.contextmanager
def chat_page() -> Iterator[Page]:
    """A page in headless Debian chromium (60 s default timeout), closed with its browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from _browser_mesh(tmp_path_factory.mktemp("browser-mesh"), CHATMESH_SIM_STEP_MS="150",
                             CHATMESH_MAX_REPLY_TOKENS="400")


@pytest.mark.timeout(240)
def test_type_stream_stop_reload_delete(slow_mesh: Mesh) -> None:
    from playwright.sync_api import expect

    with chat_page() as page:
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


@pytest.fixture(scope="module")
def quick_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from _browser_mesh(tmp_path_factory.mktemp("browser-quick"), CHATMESH_MAX_REPLY_TOKENS="24",
                             CHATMESH_SIM_REPLIES=json.dumps(TOOL_RULES))


# Scripted sim replies for the tool round trip (the other quick tests' messages match no rule)
TOOL_RULES = [{"when": "weather in Paris", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
              {"when": "celsius", "reply": "It is 21 degrees in Paris."}]


@pytest.mark.timeout(180)
def test_each_reply_shows_its_ttft_prompt_and_cached_tokens_and_replica(quick_mesh: Mesh) -> None:
    from playwright.sync_api import expect

    with chat_page() as page:
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


@pytest.mark.timeout(180)
def test_a_tool_round_trip_shows_the_call_and_the_result(quick_mesh: Mesh) -> None:
    """A conversation with a tool round trip (made through the OpenAI-compatible surface) shows, on reload, the
    call as its tool's name and arguments and the result as the tool's text: before, both were empty entries."""
    from playwright.sync_api import expect

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages: list[dict[str, object]] = [{"role": "user", "content": "What's the weather in Paris?"}]
    with httpx.Client(base_url=quick_mesh.gateway_url, timeout=60) as http:
        called = http.post("/openai/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                "tools": tools})
        assert called.status_code == 200, called.text
        reply = called.json()["choices"][0]["message"]
        (call,) = reply["tool_calls"]
        messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": '{"celsius": 21}'}]
        answered = http.post("/openai/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                  "tools": tools})
        assert answered.status_code == 200, answered.text
        conversations = http.get("/v1/conversations").json()["conversations"]
    (conversation,) = [c["id"] for c in conversations
                       if any(m.get("tool_calls") for m in http_messages(quick_mesh, c["id"]))]

    with chat_page() as page:
        page.goto(f"{quick_mesh.gateway_url}/#{conversation}")
        expect(page.locator(".message")).to_have_count(4)
        expect(page.locator(".message.user")).to_have_text("What's the weather in Paris?")
        call_block = page.locator(".message.assistant .tool-call")
        expect(call_block).to_have_count(1)
        expect(call_block.locator(".tool-heading")).to_have_text("Called get_weather")
        assert json.loads(call_block.locator("pre").inner_text()) == {"city": "Paris"}
        result = page.locator(".message.tool .tool-result")
        expect(result.locator(".tool-heading")).to_have_text("Result of get_weather")
        expect(result.locator("pre")).to_have_text('{"celsius": 21}')
        expect(page.locator(".message.assistant").last).to_have_text("It is 21 degrees in Paris.")


def http_messages(mesh: Mesh, conversation: str) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = httpx.get(f"{mesh.gateway_url}/v1/conversations/{conversation}",
                                                  timeout=30).json()["messages"]
    return messages
