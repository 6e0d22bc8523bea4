"""A background response cancelled on the real mesh (issue 28, Deliver 3: "cancel working on it"), from another
gateway than the one that started it: the official `openai` SDK against two gateway processes of one mesh, the
`sim` engine running each reply to its cap (300 tokens at 20 ms: six seconds, so the cancel lands mid-reply).
The cancel answers `cancelled` with the partial reply, generation stops there, every gateway's retrieve says the
same, and the response's stream, replayed, ends with that object (Open Responses' events checked)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from tests.e2e.conftest import start_mesh
from tests.e2e.test_openai import another_gateway
from tests.gateway.openai_client import make_key, sdk
from tests.gateway.openresponses_spec import check_response, check_stream

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CAP = 300


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("openai-background"), CHATMESH_SIM_REPLY_TOKENS="0",
                   CHATMESH_MAX_REPLY_TOKENS=str(CAP), CHATMESH_SIM_STEP_MS="20")
    try:
        yield m
    finally:
        m.stop()


async def test_a_background_response_cancelled_from_another_gateway_stops_and_keeps_its_partial_reply(
        slow_mesh: Mesh) -> None:
    key = await make_key(Path(slow_mesh.cfg[settings.DATA_DIR]), f"bg-{uuid.uuid4().hex[:8]}")
    async with another_gateway(slow_mesh) as other:
        a, b = sdk(slow_mesh.gateway_url, key), sdk(other, key)
        made = await a.responses.create(model=MODEL, input="Tell me a very long story", background=True)
        assert made.background and made.status == "in_progress"
        for _ in range(200):  # until some of the reply exists
            running = await a.responses.retrieve(made.id)
            if running.output_text:
                break
            await asyncio.sleep(0.05)
        assert running.status == "in_progress" and running.output_text
        raw_cancel = await b.responses.with_raw_response.cancel(made.id)
        check_response(raw_cancel.http_response.json())  # the object as sent (the SDK's dump adds None fields)
        cancelled = raw_cancel.parse()
        assert cancelled.status == "cancelled" and cancelled.output_text.startswith(running.output_text)
        assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < CAP
        await asyncio.sleep(0.5)  # generation has stopped: nothing more is stored
        for client in (a, b):
            got = await client.responses.retrieve(made.id)
            assert got.status == "cancelled" and got.output_text == cancelled.output_text
            assert got.usage is not None and got.usage.output_tokens == cancelled.usage.output_tokens
        async with httpx.AsyncClient(base_url=other, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
            raw = (await c.get(f"/openai/v1/responses/{made.id}", params={"stream": "true"})).text
        events = check_stream(raw)
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == cancelled.output_text
        await a.close()
        await b.close()
