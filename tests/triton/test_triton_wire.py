"""The tensors between the triton backend and its model, and the rendered config, without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from google.protobuf import text_format

from chatmesh.engine_adapter.backend import (
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateParams,
    Started,
    TierStats,
    Usage,
)
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.engine_adapter.triton import python_model, wire
from chatmesh.engine_adapter.triton.render import Deployment, parse_model_config, planned_host_cache_bytes, render
from chatmesh.engine_adapter.triton.trtllm import TrtLlmBackend
from chatmesh.mesh.config import Config
from chatmesh.mesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.model import assets, profile
from chatmesh.model.profile import ModelIdentity
from tests.conftest import need_models

CONVERSATION = ConversationId("8a3d7f0e-3f51-4c1e-9c63-0d6a2b1f9e11")


def test_generate_params_round_trip_through_tensors() -> None:
    params = GenerateParams(
        prompt_token_ids=(5, 6, 7, 8), max_tokens=9, request_id="r-1", conversation_id=CONVERSATION,
        turn_id=TurnId("1b4e28ba-2fa1-41d2-883f-0016d3cca427"), cache_salt=b"\x00owner\xff",
        platform_prefix_tokens=2, sampling=SamplingParams(temperature=0.5, top_p=0.75, seed=2**63 + 5),
        stop_token_ids=frozenset({3, 1}))
    assert wire.params_of(wire.getter(wire.request_tensors(params))) == params


def test_missing_or_bad_inputs_are_invalid_arguments() -> None:
    tensors = wire.request_tensors(GenerateParams(prompt_token_ids=(1,), max_tokens=1))
    del tensors["prompt_token_ids"]
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        wire.params_of(wire.getter(tensors))
    with pytest.raises(InvalidArgument, match="unknown command"):
        wire.command_of(wire.getter({"command": wire._bytes("reboot")}))


@pytest.mark.parametrize("event", [
    Started(cached_tokens=48, host_cached_tokens=16),
    Delta(token_ids=(1, 2, 3), text="héllo"),
    Finished(FinishReason.STOP, Usage(prompt_tokens=10, cached_prompt_tokens=4, output_tokens=3)),
    Finished(FinishReason.ERROR, Usage(1, 0, 0), error="engine failed"),
])
def test_events_round_trip_through_tensors(event: Started | Delta | Finished) -> None:
    assert wire.event_of(wire.getter(wire.event_tensors(event))) == event


def test_finished_carries_stats_and_refusals_come_back_typed() -> None:
    stats = EngineStats("r", "sim", 1, 2, 16, TierStats(10, 4, 6), TierStats(5, 0, 5), hit_tokens=7)
    served = ModelIdentity("m", "sha256:00")
    get = wire.getter(wire.event_tensors(Finished(FinishReason.LENGTH, Usage(1, 0, 1)),
                                         wire.Snapshot("e1", 3, stats, served)))
    assert wire.stats_of(get) == wire.Snapshot("e1", 3, stats, served)
    assert isinstance(wire.error_of(wire.getter(wire.error_tensors(ResourceExhausted("full")))), ResourceExhausted)
    assert isinstance(wire.error_of(wire.getter(wire.error_tensors(InvalidArgument("bad")))), InvalidArgument)
    internal = wire.getter(wire.error_tensors(RuntimeError("boom")))
    assert wire.error_of(internal) is None and "boom" in wire.error_message_of(internal)


def test_rendered_config_parses_and_declares_the_wire_tensors(tmp_path: Path) -> None:
    from tritonclient.grpc import model_config_pb2

    folder = render(Deployment(engine="sim", engine_env={"CHATMESH_SIM_STEP_MS": "5"}), tmp_path)
    config = parse_model_config((folder / "config.pbtxt").read_text())
    assert isinstance(config, model_config_pb2.ModelConfig)
    assert config.model_transaction_policy.decoupled
    type_name = model_config_pb2.DataType.Name
    assert [(i.name, type_name(i.data_type), tuple(i.dims)) for i in config.input] == list(wire.INPUTS)
    assert [(o.name, type_name(o.data_type), tuple(o.dims)) for o in config.output] == list(wire.OUTPUTS)
    assert config.parameters["engine_env"].string_value == "CHATMESH_SIM_STEP_MS=5"
    assert python_model.parse_engine_env(config.parameters["engine_env"].string_value) == {
        "CHATMESH_SIM_STEP_MS": "5"}
    assert (folder / "1" / "model.py").read_text().count("TritonPythonModel") >= 1


def test_llm_config_uses_the_llm_api_names(tmp_path: Path) -> None:
    d = Deployment(tensor_parallel_size=8, free_gpu_memory_fraction=0.85, host_cache_bytes=64 << 30)
    folder = render(d, tmp_path)
    cfg = json.loads((folder / "llm_config.json").read_text())
    assert cfg["backend"] == "pytorch" and cfg["tensor_parallel_size"] == 8 and cfg["enable_chunked_prefill"]
    kv = cfg["kv_cache_config"]
    assert kv["enable_block_reuse"] and kv["host_cache_size"] == 64 << 30 and kv["free_gpu_memory_fraction"] == 0.85
    assert kv["event_buffer_max_size"] > 0
    assert cfg["chatmesh"]["salt_policy"] == "owner"


def test_llm_config_takes_tokenizer_end_ids_and_identity_from_the_profile(tmp_path: Path) -> None:
    path = need_models(assets.LLAMA3_TOKENIZER)
    llama3 = profile.load_spec("llama3", path)
    folder = render(Deployment.for_profile(llama3, engine="trtllm"), tmp_path)
    cfg = json.loads((folder / "llm_config.json").read_text())
    assert cfg["tokenizer"] == str(llama3.tokenizer_dir) and (Path(cfg["tokenizer"]) / "tokenizer.json").is_file()
    ours = cfg["chatmesh"]
    assert ours["end_ids"] == [128001, 128008, 128009]
    assert (ours["model_id"], ours["tokenizer_digest"]) == (llama3.model_id, llama3.identity.tokenizer_digest)
    backend = TrtLlmBackend.from_file(str(folder / "llm_config.json"))
    assert backend.end_ids == {128001, 128008, 128009} and backend.model == llama3.identity
    with pytest.raises(ValueError, match="profile"):  # no end ids of a hard-coded model any more
        render(Deployment(engine="trtllm"), tmp_path)


def test_render_cli_writes_the_profile(tmp_path: Path) -> None:
    path = need_models(assets.LLAMA3_TOKENIZER)
    out = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "triton", "render", "--out", str(tmp_path),
                          "--profile", "llama3", "--model-dir", str(path), "--engine", "trtllm",
                          "--host-cache-gib", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "end ids [128001, 128008, 128009]" in out.stdout
    cfg = json.loads((tmp_path / "chatmesh_llm" / "llm_config.json").read_text())
    assert cfg["tokenizer"].endswith("Llama-3-tokenizer")
    gguf = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "triton", "render", "--out", str(tmp_path),
                           "--profile", "smollm2", "--model-dir", str(path), "--engine", "trtllm",
                           "--host-cache-gib", "1"], capture_output=True, text=True, timeout=120)
    assert gguf.returncode == 1 and "not a GGUF" in gguf.stderr


def test_a_broken_config_fails_to_parse() -> None:
    with pytest.raises(text_format.ParseError):
        parse_model_config('name: "x"\nbackend: "python"\nmax_batch_size: zero\n')
    with pytest.raises(ValueError, match="engine_env"):
        Deployment(engine_env={"CHATMESH_X": 'a";b'})


def test_planned_host_cache_holds_the_idle_history_share() -> None:
    # reference: 58.6 M idle tokens over 20 nodes, 20 KiB per token per GPU: about 60 GB per rank
    per_rank = planned_host_cache_bytes(gpu="h100", tp=8, host_memory_gib=4096)
    assert 50e9 < per_rank < 70e9
    assert planned_host_cache_bytes(gpu="h100", tp=8, host_memory_gib=80) == 10 << 30


def test_auto_engine_falls_back_where_tensorrt_llm_is_absent() -> None:
    import importlib.util

    expected = "trtllm" if importlib.util.find_spec("tensorrt_llm") else "sim"
    assert python_model.engine_choice("auto", "sim") == expected
    assert python_model.engine_choice("local", "sim") == "local"


def test_chatmesh_triton_render_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chatmesh.mesh.cli import main

    code = main(["triton", "render", "--out", str(tmp_path), "--tp", "4", "--host-cache-gib", "8",
                 "--engine-env", "CHATMESH_SIM_STEP_MS=3"])
    assert code == 0 and "parsed as ModelConfig" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "chatmesh_llm" / "llm_config.json").read_text())
    assert cfg["tensor_parallel_size"] == 4 and cfg["kv_cache_config"]["host_cache_size"] == 8 << 30
    config = parse_model_config((tmp_path / "chatmesh_llm" / "config.pbtxt").read_text())
    assert config.parameters["engine_env"].string_value == "CHATMESH_SIM_STEP_MS=3"  # type: ignore[attr-defined]
    assert main(["triton", "render", "--out", str(tmp_path), "--kv-fraction", "1.5"]) == 1


def test_build_backend_connects_or_renders_a_local_server(tmp_path: Path) -> None:
    from chatmesh.engine_adapter.triton import build_backend
    from chatmesh.engine_adapter.triton.backend import TritonBackend
    from chatmesh.mesh.config import Config

    from chatmesh.mesh import pki

    pki.ensure(tmp_path / "certs")  # a remote Triton is reached over mutual TLS with the engine's certificate
    remote = build_backend(Config(env={"CHATMESH_TRITON_ADDRESS": "triton-7:8001", "CHATMESH_REPLICA_ID": "n7",
                                       "CHATMESH_DATA_DIR": str(tmp_path)}))
    assert isinstance(remote, TritonBackend) and remote.server is None and remote.address == "triton-7:8001"
    env = {"CHATMESH_DATA_DIR": str(tmp_path), "CHATMESH_REPLICA_ID": "e1", "CHATMESH_TRITON_ENGINE": "sim",
           "CHATMESH_SIM_STEP_MS": "4", "CHATMESH_ENGINE": "triton"}
    local = build_backend(Config(env=env))
    assert isinstance(local, TritonBackend) and local.server is not None and not local.server.running()
    folder = tmp_path / "triton" / "e1" / "repository" / "chatmesh_llm"
    config = parse_model_config((folder / "config.pbtxt").read_text())
    engine_env = python_model.parse_engine_env(config.parameters["engine_env"].string_value)  # type: ignore[attr-defined]
    assert engine_env["CHATMESH_SIM_STEP_MS"] == "4" and "CHATMESH_ENGINE" not in engine_env
    assert config.parameters["engine"].string_value == "sim"  # type: ignore[attr-defined]


async def test_unavailable_before_the_first_token_is_retried_invisibly() -> None:
    import grpc

    from chatmesh.engine_adapter.triton import backend as tb

    attempts: list[int] = []

    class Flaky(tb.TritonBackend):
        async def _stream(self, inputs: object, cancel: object = None) -> AsyncGenerator[wire.Getter, None]:
            attempts.append(1)
            yield wire.getter(wire.event_tensors(Started(cached_tokens=0, host_cached_tokens=0)))
            if len(attempts) < 3:
                raise tb._StreamFailed("UNAVAILABLE: connection reset", grpc.StatusCode.UNAVAILABLE)
            yield wire.getter(wire.event_tensors(Delta((5,), "five")))
            yield wire.getter(wire.event_tensors(Finished(FinishReason.LENGTH, Usage(1, 0, 1))))

    b = Flaky(tb.TritonOptions(address="triton-9:8001", retries=2))
    events = [e async for e in b.generate(GenerateParams((1,), 1))]
    assert len(attempts) == 3
    assert [type(e) for e in events] == [Started, Delta, Finished]  # one Started, though three were received
    b = Flaky(tb.TritonOptions(address="triton-9:8001", retries=1))
    attempts.clear()
    with pytest.raises(Unavailable, match="triton-9:8001"):
        [e async for e in b.generate(GenerateParams((1,), 1))]
    assert len(attempts) == 2


def test_started_and_the_first_delta_travel_as_one_response() -> None:
    started, delta = Started(cached_tokens=32, host_cached_tokens=0), Delta((9, 10), "a b")
    stats = EngineStats("r", "sim", 0, 1, 16, TierStats(10, 4, 6), TierStats(0, 0, 0))
    get = wire.getter(wire.first_tensors(started, delta, wire.Snapshot("e", 1, stats)))
    assert wire.kind_of(get) is wire.WireEvent.FIRST
    assert wire.events_of(get) == [started, delta]
    assert wire.stats_of(get) == wire.Snapshot("e", 1, stats)
    assert wire.events_of(wire.getter(wire.event_tensors(delta))) == [delta]


def test_residency_and_its_cursor_round_trip_through_tensors() -> None:
    from chatmesh.engine_adapter.backend import Residency
    from chatmesh.engine_adapter.residency import FROM_START
    from chatmesh.mesh.ids import ConversationId

    for cursor in (FROM_START, 0, 41):
        assert wire.cursor_of(wire.getter(wire.command_tensors(wire.Command.RESIDENCY, cursor))) == cursor
    r = Residency(7, True, ((ConversationId("c1"), 64), (ConversationId("c2"), 0)))
    assert wire.residency_of(wire.getter(wire.residency_tensors("epoch-1", r))) == ("epoch-1", r)
    assert wire.residency_of(wire.getter(wire.residency_tensors("epoch-1", None))) == ("epoch-1", None)
