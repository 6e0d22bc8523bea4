"""The README's tool-calling example, run as written (issue 28, Deliver 7), with the official `openai` SDK against
the real edge and mesh serving the default model profile (SmolLM2: ChatML, the `<tool_call>` convention), the
`sim` engine scripted to call the tool when asked about the weather and to answer once it has the result. The
example's Chat Completions and Responses round trips both end with the scripted answer, each stored as one
conversation of call, result and answer. (tests/e2e/test_openai_tools.py covers Llama 3.1's format.)"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatmesh.mesh import settings
from chatmesh.mesh.up import Mesh
from tests.e2e.conftest import start_mesh
from tests.gateway.openai_client import make_key

README = Path(__file__).resolve().parents[2] / "README.md"
ANSWER = "It is 21 degrees in Paris."
RULES = [{"when": "weather in Paris", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
         {"when": "celsius", "reply": ANSWER}]


def readme_tool_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (example,) = [b for b in blocks if "tool_calls[0]" in b and "function_call_output" in b]
    return str(example)


@pytest.fixture(scope="module")
def smollm2_tools_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("openai-tools-readme"), CHATMESH_MAX_REPLY_TOKENS="24",
                   CHATMESH_SIM_REPLIES=json.dumps(RULES), CHATMESH_SIM_STEP_MS="5")
    try:
        yield m
    finally:
        m.stop()


async def test_the_readmes_tool_example_runs_as_written(smollm2_tools_mesh: Mesh) -> None:
    mesh = smollm2_tools_mesh
    key = await make_key(Path(mesh.cfg[settings.DATA_DIR]), f"readme-{uuid.uuid4().hex[:8]}")
    client = openai.AsyncOpenAI(base_url=mesh.gateway_url + "/openai/v1", api_key=key, max_retries=0, timeout=30)
    # the example is synchronous; it runs on an async client the same way once each call is awaited
    code = re.sub(r"client\.(chat\.completions|responses)\.create\(", r"await client.\1.create(",
                  readme_tool_example())
    scope: dict[str, Any] = {"client": client}
    exec(compile("async def example():\n" + "".join(f"    {line}\n" for line in code.splitlines())
                 + "    return locals()\n", "README.md", "exec"), scope)
    try:
        done: dict[str, Any] = await scope["example"]()
    finally:
        await client.close()
    assert done["asked"].choices[0].finish_reason == "tool_calls"
    assert json.loads(done["asked"].choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert done["answer"].choices[0].message.content == ANSWER
    assert done["r"].output[0].type == "function_call" and done["done"].output_text == ANSWER
    async with httpx.AsyncClient(base_url=mesh.gateway_url, headers={"Authorization": f"Bearer {key}"}) as http:
        convs = (await http.get("/v1/conversations")).json()["conversations"]
        stored = [(await http.get(f"/v1/conversations/{c['id']}")).json()["messages"] for c in convs]
    assert sorted([m["role"] for m in conv] for conv in stored) == [["user", "assistant", "tool", "assistant"]] * 2
    assert all(conv[-1]["content"] == ANSWER for conv in stored)
