"""Schema-driven fuzzing: schemathesis generates requests from /openapi.json for every operation and checks that
the edge never answers 5xx, answers only documented status codes and content types, and that JSON responses
match their schemas. Bounded: a few examples per operation and a time limit on the whole run.

The gateway and its FakeChat run in a background thread with their own event loop, because schemathesis calls
the server synchronously from the test."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from chatmesh.gateway.app import server_for
from chatmesh.gateway.openapi import DOCUMENT
from chatmesh.mesh.config import Config
from tests.conftest import free_port
from tests.gateway.fake_chat import start_fake_chat
from tests.trust import gateway_env


@pytest.fixture(scope="module")
def edge_url(mesh_certs: Path) -> Iterator[str]:
    chat_port, port = free_port(), free_port()
    ready = threading.Event()
    stop = threading.Event()
    failure: list[BaseException] = []

    async def main(data_dir: str) -> None:
        grpc_server, _ = await start_fake_chat(chat_port, mesh_certs)
        server = server_for(Config(env={**gateway_env(mesh_certs), "CHATMESH_CHAT_ADDRESS": f"127.0.0.1:{chat_port}",
                                        "CHATMESH_DATA_DIR": data_dir, "CHATMESH_LIMIT_TURNS_PER_MINUTE": "100000",
                                        "CHATMESH_LIMIT_OPEN_STREAMS": "1000",
                                        # every refused login or bad key counts against the fuzzer's one address
                                        "CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE": "100000"}), port=port)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        ready.set()
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.05)
        server.should_exit = True
        await task
        await grpc_server.stop(0)

    def run() -> None:
        with tempfile.TemporaryDirectory() as data_dir:
            try:
                asyncio.run(main(data_dir))
            except BaseException as err:  # reported by the fixture below
                failure.append(err)
                ready.set()

    thread = threading.Thread(target=run, name="edge-under-fuzz", daemon=True)
    thread.start()
    assert ready.wait(30), "the gateway did not start"
    assert not failure, failure
    yield f"http://127.0.0.1:{port}"
    stop.set()
    thread.join(20)
    assert not failure, failure


@pytest.mark.timeout(300)
def test_no_server_errors_and_responses_match_the_schema(edge_url: str) -> None:
    # Driven by hand rather than through schemathesis' pytest plugin, which does not support this pytest.
    schema = schemathesis.openapi.from_url(f"{edge_url}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = 0
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case[Any]) -> None:
            case.call_and_validate(timeout=10, checks=checks)

        fuzz()
    assert operations == sum(1 for item in DOCUMENT["paths"].values() for method in item if method != "parameters")
