"""Open WebUI against chatmesh in a real browser (issue 28's Done-when, run as a bench script: Open WebUI pulls torch,
too heavy for the test command). A real Open WebUI (PyPI `open-webui`, in its own virtualenv, started offline)
set up as the README says, with its defaults (built-in tools on), driven in headless Chromium (Debian's, through
Playwright): a chat of two turns streams a reply, turn 2 is served from the prefix cache, and with the README's
connection headers no background task (title, tags, follow-ups) leaves a conversation behind. Two Open WebUI
users chat so (the admin, then an ordinary user who sees the model through the README's access grant): each is a
chatmesh owner of their own, with one conversation.

    python3.11 -m venv .owui-venv
    .owui-venv/bin/pip install --find-links /opt/wheels torch==2.13.0     # pinned first: taken from the local file
    .owui-venv/bin/pip install open-webui==0.12.4
    flock /work/coord/heavy.lock .venv/bin/python -m bench.openwebui_browser [--owui .owui-venv]

What it checks, and how: the engine's own counters (GenerateService.GetStats: hit tokens) and the store's turn
records (prompt and cached prompt tokens per turn) say turn 2 reused turn 1's prefix; the gateway's log counts
the turns served (the chat's two and the background tasks'); the store's SQLite file says how many conversations
each owner has (one: the chat; Open WebUI's background tasks carry `X-OpenWebUI-Task` and answer in throwaway
conversations the edge deletes). Exit 0 when all hold and at least one background task ran. `--keep DIR` keeps
the logs (mesh and Open WebUI) and a screenshot per turn (failed.png when the browser part fails).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import httpx

from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from chatmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.conftest import free_port
from tests.e2e.conftest import channel, mesh_env
from tests.gateway.openai_client import make_key

CHROMIUM = "/usr/bin/chromium"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
HEADERS = {"X-OpenWebUI-Message-Id": "{{MESSAGE_ID}}", "X-OpenWebUI-Task": "{{TASK}}"}


async def engine_hits(mesh: Mesh) -> int:
    async with channel(mesh, "engine") as ch:
        stats = (await generate_pb2_grpc.GenerateServiceStub(ch).GetStats(generate_pb2.GetStatsRequest())).stats
        return int(stats.hit_tokens)


def hits_now(mesh: Mesh) -> int:
    """engine_hits from a thread of its own (Playwright's sync API runs an event loop in the calling thread)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, engine_hits(mesh)).result()


def conversations_per_owner(data_dir: Path) -> dict[str, int]:
    db = next(data_dir.rglob("*.db"))
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT owner_id, count(*) FROM conversations GROUP BY owner_id").fetchall())


def stored_turns(data_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """Per owner, (prompt tokens, of them served from the cache) of every turn the store keeps, oldest first."""
    db = next(data_dir.rglob("*.db"))
    out: dict[str, list[tuple[int, int]]] = {}
    with sqlite3.connect(db) as conn:
        for owner, p, c in conn.execute(
                "SELECT owner_id, prompt_tokens, cached_prompt_tokens FROM turns ORDER BY created_at_ms"):
            out.setdefault(owner, []).append((int(p), int(c)))
    return out


def turns_ended(gateway_log: Path) -> int:
    """How many turns the gateway served (its turn_stream_ended log lines): the chat's and the background tasks'."""
    return sum('"turn_stream_ended"' in line for line in gateway_log.read_text().splitlines())


def versions(owui: Path) -> dict[str, str]:
    from importlib.metadata import version

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()

    return {"open-webui": run(str(owui / "bin" / "python"), "-c", "import importlib.metadata as m;"
                                                                  "print(m.version('open-webui'))"),
            "chromium": run(CHROMIUM, "--version"), "playwright": version("playwright"),
            "chatmesh": run("git", "rev-parse", "--short", "HEAD")}


def start_open_webui(owui: Path, folder: Path, port: int, base_url: str, key: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DATA_DIR": str(folder), "PORT": str(port), "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1",
           "WEBUI_SECRET_KEY": "bench", "ENABLE_OLLAMA_API": "false", "OPENAI_API_BASE_URL": base_url,
           "OPENAI_API_KEY": key, "ENABLE_FORWARD_USER_INFO_HEADERS": "true", "DEFAULT_MODELS": MODEL,
           "ENABLE_SIGNUP": "true", "BYPASS_MODEL_ACCESS_CONTROL": "true", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false"}
    log = (folder / "open-webui.log").open("wb")
    return subprocess.Popen([str(owui / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


USERS = [("Ada", "ada@example.com"), ("Grace", "grace@example.com")]  # the admin, then a user of Open WebUI's own


async def sign_up(url: str) -> list[str]:
    """The first account (Open WebUI makes it the admin), the README's connection headers set through its API, and
    a second, ordinary user the admin adds (it sees the model through BYPASS_MODEL_ACCESS_CONTROL, the README's
    access grant). Their tokens, in USERS' order."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(600):
            try:
                if (await http.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
        (admin_name, admin_email), *others = USERS
        signed = await http.post("/api/v1/auths/signup", json={"name": admin_name, "email": admin_email,
                                                               "password": "bench-password"})
        signed.raise_for_status()
        tokens: list[str] = [signed.json()["token"]]
        auth = {"Authorization": f"Bearer {tokens[0]}"}
        for name, email in others:  # the admin adds them (sign-up closes after the first account), they sign in
            (await http.post("/api/v1/auths/add", headers=auth, json={
                "name": name, "email": email, "password": "bench-password", "role": "user"})).raise_for_status()
            signed = await http.post("/api/v1/auths/signin", json={"email": email, "password": "bench-password"})
            signed.raise_for_status()
            tokens.append(signed.json()["token"])
        config = (await http.get("/openai/config", headers=auth)).json()
        config["OPENAI_API_CONFIGS"] = {"0": {**config.get("OPENAI_API_CONFIGS", {}).get("0", {}), "enable": True,
                                              "headers": HEADERS}}
        (await http.post("/openai/config/update", headers=auth, json=config)).raise_for_status()
        return tokens


def browser_chat(url: str, token: str, messages: list[str], after_each: Callable[[], int],
                 shots: Path, name: str) -> list[tuple[str, int]]:
    """One chat in the browser: each message sent, its reply streamed to its end; `after_each`'s answer with it."""
    from playwright.sync_api import sync_playwright

    replies = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
            "--no-first-run", "--disable-component-update", "--disable-sync"])
        page = browser.new_page()
        page.goto(url)
        page.evaluate(f"localStorage.setItem('token', {json.dumps(token)})")
        page.goto(url)
        page.locator("#chat-input").wait_for(timeout=60_000)
        time.sleep(2)
        button = page.get_by_role("button", name="Okay, Let's Go!", exact=True)  # the first login's "what's new"
        if button.count() and button.first.is_visible():
            button.first.click(timeout=5000)
        page.keyboard.press("Escape")
        try:
            for i, text in enumerate(messages):
                replies.append(_turn(page, i, text, after_each))
                page.screenshot(path=str(shots / f"{name}-turn{i + 1}.png"))
        except Exception:
            page.screenshot(path=str(shots / f"{name}-failed.png"))
            raise
        finally:
            browser.close()
    return replies


def _turn(page: Any, i: int, text: str, after_each: Callable[[], int]) -> tuple[str, int]:
    """One message typed and sent; its reply (the i-th) waited for until its text stops growing."""
    box = page.locator("#chat-input")
    box.click()
    box.fill(text)
    page.keyboard.press("Enter")
    reply = page.locator("#response-content-container").nth(i)
    reply.wait_for(timeout=120_000)
    deadline = time.monotonic() + 120
    last = ""
    while time.monotonic() < deadline:  # streamed: wait until the text stops growing
        time.sleep(1.0)
        now = reply.inner_text()
        if now and now == last:
            break
        last = now
    return last, after_each()


CHATS = [["What is the capital of France?", "And of Japan?"], ["Name a prime number.", "And a larger one?"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owui", default=".owui-venv", help="the virtualenv Open WebUI is installed in")
    parser.add_argument("--keep", help="work in this folder and keep it (logs, screenshots) instead of a temporary one")
    args = parser.parse_args()
    owui = Path(args.owui).resolve()
    if not (owui / "bin" / "open-webui").exists():
        print(f"no Open WebUI in {owui}; see this script's docstring", file=sys.stderr)
        return 2
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as tmp:
        env = mesh_env(Path(tmp) / "data", CHATMESH_AUTH="required", CHATMESH_MAX_REPLY_TOKENS="48")
        mesh = Mesh(env=env, log_dir=Path(tmp) / "logs", start_timeout_s=180)
        mesh.start()
        webui: subprocess.Popen[bytes] | None = None
        try:
            data_dir = Path(mesh.cfg[settings.DATA_DIR])
            key = asyncio.run(make_key(data_dir, "webui", frontend=True))
            port = free_port()
            webui = start_open_webui(owui, Path(tmp), port, mesh.gateway_url + "/openai/v1", key)
            url = f"http://127.0.0.1:{port}"
            tokens = asyncio.run(sign_up(url))
            chats = {}
            for (name, _), token, messages in zip(USERS, tokens, CHATS):
                before = asyncio.run(engine_hits(mesh))
                (first, between), (second, after) = browser_chat(url, token, messages, lambda: hits_now(mesh),
                                                                 Path(tmp), name)
                chats[name] = {"reply_chars": [len(first), len(second)],
                               "engine_hit_tokens": [between - before, after - between]}
            time.sleep(5)  # background tasks (title, tags, follow-ups) finish and their conversations are deleted
            owners = conversations_per_owner(data_dir)
            stored = stored_turns(data_dir)
            ended = turns_ended(Path(tmp) / "logs" / "gateway.log")
            kept = sum(len(t) for t in stored.values())
            print(json.dumps({
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(owui),
                "chats": chats,
                "stored_turns": {o: [{"prompt_tokens": p, "cached_prompt_tokens": c} for p, c in t]
                                 for o, t in stored.items()},
                "turns_served": ended, "background_turns": ended - kept,
                "conversations_per_owner": owners}, indent=2))
            ok = (all(all(c["reply_chars"]) and c["engine_hit_tokens"][1] > 0 for c in chats.values())
                  and len(stored) == len(USERS) and all(len(t) == 2 and t[1][1] > 0 for t in stored.values())
                  and ended > kept and len(owners) == len(USERS) and all(n == 1 for n in owners.values()))
            return 0 if ok else 1
        finally:
            if webui is not None:
                webui.terminate()
                webui.wait(30)
            mesh.stop()


if __name__ == "__main__":
    raise SystemExit(main())
