"""`chatmesh up --engines N --chats N`: several engine replicas and chat processes on one host, each with its own
metrics port, all of them in the scrape config `chatmesh status --scrape-config` prints."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from chatmesh.mesh import status
from chatmesh.mesh.config import Config
from chatmesh.mesh.up import MeshError, metrics_targets, scaled
from tests.conftest import free_port, port_open
from tests.e2e.conftest import grpcurl_path, mesh_env


def test_replicas_and_chat_processes_listen_ten_ports_apart() -> None:
    env, extra = scaled(Config(env={}), engines=3, chats=2)
    assert env == {"CHATMESH_REPLICAS": "engine-0=127.0.0.1:50054,engine-1=127.0.0.1:50064,engine-2=127.0.0.1:50074",
                   "CHATMESH_CHAT_ADDRESSES": "127.0.0.1:50051,127.0.0.1:50061"}
    assert [(x.name, x.service, x.address, dict(x.env), x.metrics_port) for x in extra] == [
        ("engine-1", "engine", "127.0.0.1:50064", {"CHATMESH_REPLICA_ID": "engine-1"}, 9164),
        ("engine-2", "engine", "127.0.0.1:50074", {"CHATMESH_REPLICA_ID": "engine-2"}, 9174),
        ("chat-1", "chat", "127.0.0.1:50061", {"CHATMESH_CHAT_INSTANCE_ID": "chat-1"}, 9161)]


def test_every_process_has_its_own_metrics_port_and_is_listed() -> None:
    cfg = Config(env={})
    _, extra = scaled(cfg, engines=4, chats=3)
    targets = metrics_targets(cfg, extra)
    assert [(t.process, t.url) for t in targets if t.service in ("engine", "chat")] == [
        ("chat-0", "http://127.0.0.1:9151/metrics"), ("chat-1", "http://127.0.0.1:9161/metrics"),
        ("chat-2", "http://127.0.0.1:9171/metrics"),
        ("engine-0", "http://127.0.0.1:9154/metrics"), ("engine-1", "http://127.0.0.1:9164/metrics"),
        ("engine-2", "http://127.0.0.1:9174/metrics"), ("engine-3", "http://127.0.0.1:9184/metrics")]
    ports = [int(t.url.rsplit(":", 1)[1].removesuffix("/metrics")) for t in targets]
    assert len(ports) == len(set(ports)) == 6 + 3 + 2  # six services, three more engines, two more chats
    grpc_ports = {int(x.address.rsplit(":", 1)[1]) for x in extra}
    assert not grpc_ports & set(ports)


def test_the_scrape_config_covers_every_replica() -> None:
    cfg = Config(env={})
    _, extra = scaled(cfg, engines=3, chats=2)
    parsed = yaml.safe_load(status.scrape_config(cfg, extra=extra))
    jobs = {j["job_name"]: j["static_configs"] for j in parsed["scrape_configs"]}
    assert jobs["chatmesh-engine"] == [
        {"targets": ["127.0.0.1:9154"], "labels": {"service": "engine", "process": "engine-0"}},
        {"targets": ["127.0.0.1:9164"], "labels": {"service": "engine", "process": "engine-1"}},
        {"targets": ["127.0.0.1:9174"], "labels": {"service": "engine", "process": "engine-2"}}]
    assert jobs["chatmesh-chat"] == [
        {"targets": ["127.0.0.1:9151"], "labels": {"service": "chat", "process": "chat-0"}},
        {"targets": ["127.0.0.1:9161"], "labels": {"service": "chat", "process": "chat-1"}}]
    assert jobs["chatmesh-store"] == [{"targets": ["127.0.0.1:9152"], "labels": {"service": "store"}}]
    # one of each: the repo's config, unchanged
    assert status.scrape_config(cfg, extra=scaled(cfg, 1, 1)[1]) == status.scrape_config(cfg)


def test_metrics_off_stays_off_for_the_replicas_and_a_collision_is_refused() -> None:
    _, extra = scaled(Config(env={"CHATMESH_ENGINE_METRICS_PORT": "0"}), engines=2, chats=1)
    assert [x.metrics_port for x in extra] == [0]
    # engine-1's metrics would land on the chat's metrics port
    with pytest.raises(MeshError, match="engine-1 .metrics. would listen on port 9151, which is chat .metrics."):
        scaled(Config(env={"CHATMESH_ENGINE_METRICS_PORT": "9141"}), engines=2, chats=2)


def test_one_of_each_changes_nothing_and_a_replica_list_is_not_overridden() -> None:
    assert scaled(Config(env={}), 1, 1) == ({}, [])
    with pytest.raises(MeshError, match="CHATMESH_REPLICAS"):
        scaled(Config(env={"CHATMESH_REPLICAS": "a=h:1"}), 2, 1)
    with pytest.raises(MeshError, match="at least 1"):
        scaled(Config(env={}), 0, 1)


def _free_pair() -> int:
    """A port p with p and p + 10 both free (a replica steps ten ports up)."""
    for _ in range(200):
        port = free_port()
        if port + 10 < 65536 and not port_open("127.0.0.1", port + 10, 0.05):
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


@pytest.mark.slow
def test_chatmesh_up_scaled_prints_every_processes_metrics_and_each_answers(tmp_path: Path) -> None:
    """`chatmesh up --engines 2 --chats 2`, the real command: every process serves its own /metrics where the
    banner says, and `chatmesh status --scrape-config` with the same flags scrapes exactly those."""
    env = mesh_env(tmp_path / "data", CHATMESH_LOG_LEVEL="warning")
    for name in ("CHATMESH_ENGINE_METRICS_PORT", "CHATMESH_CHAT_METRICS_PORT"):
        env[name] = str(_free_pair())
    for name in ("CHATMESH_ENGINE_ADDRESS", "CHATMESH_CHAT_ADDRESS"):
        env[name] = f"127.0.0.1:{_free_pair()}"
    env = {**os.environ, **env}
    cli = [sys.executable, "-m", "chatmesh.mesh.cli"]
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        up = subprocess.Popen([*cli, "up", "--engines", "2", "--chats", "2"], env=env, stdout=sink,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while "Press Ctrl-C to stop." not in out.read_text() and time.monotonic() < deadline:
            assert up.poll() is None, out.read_text()
            time.sleep(0.5)
        banner = out.read_text()
        assert "Press Ctrl-C to stop." in banner, banner
        listed = dict(re.findall(r"^  (\S+)\s+(http://\S+/metrics)$", banner.split("Prometheus metrics")[1],
                                 re.MULTILINE))
        assert set(listed) == {"gateway", "chat-0", "chat-1", "store", "router", "engine-0", "engine-1",
                               "moderation"}, banner
        assert len(set(listed.values())) == len(listed)
        assert "chatmesh status --engines 2 --chats 2 --scrape-config" in banner
        for process, url in listed.items():
            text = httpx.get(url, timeout=10).text
            if process.startswith("engine"):
                assert "vllm:num_requests_running" in text, process
            if process.startswith("chat"):
                assert "chatmesh_chat_turns_total" in text, process
        scrape = subprocess.run([*cli, "status", "--engines", "2", "--chats", "2", "--scrape-config"], env=env,
                                capture_output=True, text=True, timeout=60, check=True).stdout
        targets = {f"http://{t}/metrics" for job in yaml.safe_load(scrape)["scrape_configs"]
                   for c in job["static_configs"] for t in c["targets"]}
        assert targets == set(listed.values())
        shown = subprocess.run([*cli, "status", "--engines", "2", "--chats", "2"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert re.search(r"engine-1\s+SERVING", shown.stdout) and re.search(r"chat-1\s+SERVING", shown.stdout)
        grpcurl = grpcurl_path()
        if grpcurl is not None:  # the README's grpcurl line for a mesh with mutual TLS, against engine-1
            certs = tmp_path / "data" / "certs"
            engine_1 = env["CHATMESH_ENGINE_ADDRESS"].rsplit(":", 1)
            asked = subprocess.run([grpcurl, "-cacert", str(certs / "ca.pem"), "-cert", str(certs / "operator.pem"),
                                    "-key", str(certs / "operator-key.pem"), "-servername", "engine.chatmesh",
                                    "-d", "{}", f"{engine_1[0]}:{int(engine_1[1]) + 10}",
                                    "chatmesh.v1.GenerateService/GetStats"], capture_output=True, text=True,
                                   timeout=30)
            assert asked.returncode == 0 and '"stats"' in asked.stdout, asked.stdout + asked.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
