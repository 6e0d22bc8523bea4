"""The launcher starts the real tritonserver (from nvidia-pytriton) on ephemeral ports and stops it with its stubs."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import need

from chatmesh.engine_adapter.triton.launcher import TritonInstall, TritonMissing, TritonServer

MODELS = Path(__file__).parent / "models"


def _install() -> TritonInstall:
    try:
        return TritonInstall.find()
    except TritonMissing as err:
        need(False, f"tritonserver ({err})")
        raise


def echo(client: object) -> list[int]:
    """Streams [5, 6, 7] through the decoupled echo model; the token ids it sends back."""
    import tritonclient.grpc as grpcclient

    assert isinstance(client, grpcclient.InferenceServerClient)
    responses: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inp = grpcclient.InferInput("token_ids", [3], "INT32")
    inp.set_data_from_numpy(np.array([5, 6, 7], dtype=np.int32))
    client.async_stream_infer("echo", [inp], enable_empty_final_response=True)
    got: list[int] = []
    try:
        while True:
            result, error = responses.get(timeout=30)
            assert error is None, error
            response = result.get_response()  # type: ignore[attr-defined]
            if response.outputs:
                got.extend(int(t) for t in result.as_numpy("token_id"))  # type: ignore[attr-defined]
            if response.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()


def test_backend_folder_holds_library_utils_and_stub(tmp_path: Path) -> None:
    install = _install()
    folder = install.prepare_backends(tmp_path) / "python"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    env = install.environment({"PATH": "/usr/bin"})
    assert str(install.libs) in env["LD_LIBRARY_PATH"].split(":")
    assert env["PATH"].split(":")[0].endswith("/bin") and env["PATH"] != "/usr/bin"


def test_decoupled_echo_model_streams_and_server_stops() -> None:
    import tritonclient.grpc as grpcclient

    server = TritonServer(MODELS, models=["echo"], install=_install())
    server.start()
    try:
        assert server.running()
        client = grpcclient.InferenceServerClient(server.address)
        got = echo(client)
        client.close()
        assert got == [5, 6, 7]
    finally:
        pid = server.pid
        server.stop()
    assert not server.running()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
