"""Issue 30's insider findings against a real mesh (every service its own process, mutual TLS on every hop, the
dev files laid out as `chatmesh up` lays them), each tried as the attacker did and shown refused:

- the CA's key: no service process opens it while the mesh runs (inotify on the file), and a certificate minted
  with any key a service does read (its own TLS key; the gateway's token signing keys) is refused by the mesh;
- a 100-year owner token signed with the real key; a token replayed from another identity; a retired key's token
  that chat had already verified (cached);
- IssueOwnerToken without a grant, or for an owner the gateway does not know; a grant taken out of the file
  (no restart) mints nothing more;
- six turns from an internal client over its grant's per-turn budget (asking for allowance 1, or none);
- Generate without the conversation a token is bound to; Evict of another owner's conversation;
- the wide JSON body (refused before it is parsed; /healthz and an open stream keep answering meanwhile);
- X-Forwarded-For from loopback with no proxy configured; the development pepper on a gateway configured for a
  public origin;
- the outsider probes (plaintext, no certificate, a foreign CA, expired or not yet valid, a wrong SPIFFE id)
  against every port of this running mesh (also, one test per class on single servers, tests/mesh/test_trust.py
  and test_authz_rpcs.py).

The edge budget across gateways is tests/e2e/test_prompt_limits.py's (its own mesh: two gateways, one Redis)."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chatmesh.gateway.cli import accounts_for
from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, settings, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.identity import Identity
from chatmesh.mesh.ids import OwnerId
from chatmesh.mesh.trust import service_trust
from chatmesh.mesh.up import Mesh
from chatmesh.v1 import chat_pb2, chat_pb2_grpc, generate_pb2, generate_pb2_grpc, owner_token_pb2, owner_token_pb2_grpc
from tests.e2e.conftest import start_mesh
from tests.trust import channel_as

pytestmark = pytest.mark.slow

GRANTS = {"owner_token_grants": {
    "spiffe://chatmesh/client/dev": {"owners": ["alice"], "scopes": ["read", "turns"], "prompt_tokens_per_turn": 600}}}
LONG = " ".join(f"line {i}: the shipment for warehouse {i * 7} was counted twice." for i in range(120))  # ~2k tokens


class Inotify:
    """Counts opens of one file by any process (Linux inotify through libc: no package needed)."""

    IN_ACCESS, IN_OPEN, IN_NONBLOCK = 0x1, 0x20, 0o4000

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert self._libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_OPEN | self.IN_ACCESS) >= 0

    def events(self) -> int:
        count = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return count
            offset = 0
            while offset < len(data):  # struct inotify_event: wd, mask, cookie, len, name[len]
                length = int.from_bytes(data[offset + 12:offset + 16], "little")
                offset += 16 + length
                count += 1

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Insider:
    mesh: Mesh
    keys: dict[str, str]  # user -> API key
    users: dict[str, OwnerId]  # user -> owner id
    ca_key_opens: Inotify

    @property
    def certs(self) -> Path:
        return self.mesh.certs

    def chat(self, who: Identity) -> grpc.aio.Channel:
        return channel_as(self.certs, who, self.mesh.cfg[settings.CHAT_ADDRESS], "chat")

    def edge(self, user: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.mesh.gateway_url, timeout=60,
                                 headers={"authorization": f"Bearer {self.keys[user]}"})

    async def issue(self, who: Identity, **request: Any) -> owner_token_pb2.IssueOwnerTokenResponse:
        async with channel_as(self.certs, who, self.mesh.cfg[settings.OWNER_TOKEN_ADDRESS], "gateway") as channel:
            return await owner_token_pb2_grpc.OwnerTokenServiceStub(channel).IssueOwnerToken(
                owner_token_pb2.IssueOwnerTokenRequest(**request), timeout=10)


async def _users(env: dict[str, str]) -> tuple[dict[str, OwnerId], dict[str, str]]:
    accounts = accounts_for(Config(env=env))
    try:
        await accounts.create_tables()
        users = {name: await accounts.create_user(name) for name in ("alice", "bob")}
        return users, {name: await accounts.create_key(name) for name in users}
    finally:
        await accounts.close()


@pytest.fixture(scope="module")
def insider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Insider]:
    tmp = tmp_path_factory.mktemp("insider")
    (tmp / "authz.json").write_text(json.dumps(GRANTS))
    extra = {"CHATMESH_AUTH": "required", "CHATMESH_MESH_AUTHZ_FILE": str(tmp / "authz.json"),
             "CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE": "5", "CHATMESH_MAX_REPLY_TOKENS": "8"}
    data = tmp / "data"
    pki.ensure(data / "certs", pki.default_identities(["dev", "reports"]))  # before start: nothing left to issue
    env = {"CHATMESH_DATA_DIR": str(data)}
    users, keys = asyncio.run(_users(env))
    opens = Inotify(pki.ca_folder(data / "certs") / pki.CA_KEY_FILE)
    mesh = start_mesh(tmp, **extra)
    try:
        yield Insider(mesh, keys, users, opens)
    finally:
        mesh.stop()
        opens.close()


async def sse_turn(client: httpx.AsyncClient, conv: str, content: str) -> list[str]:
    async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                             json={"turn_id": str(uuid.uuid4()), "content": content}) as r:
        assert r.status_code == 200, await r.aread()
        return [line for line in [ln async for ln in r.aiter_lines()] if line.startswith("event:")]


def _cert_signed_by(key: Any, issuer: x509.Name, who: str, *, start: datetime.datetime | None = None,
                    days: float = 1) -> tuple[bytes, bytes]:
    """A client certificate for `who` claiming `issuer`, signed with `key` (what a stolen key lets one mint),
    valid from `start` (default five minutes ago) for `days`."""
    own = ec.generate_private_key(ec.SECP256R1())
    start = start or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "evil")]))
            .issuer_name(issuer).public_key(own.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(who)]), critical=True)
            .sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), own.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


async def test_no_service_reads_the_ca_key_and_no_key_a_service_reads_mints_a_certificate(insider: Insider) -> None:
    async with insider.edge("bob") as bob:
        conv = (await bob.post("/v1/conversations", json={})).json()["id"]
        assert (await sse_turn(bob, conv, "Hello"))[-1] == "event: turn.completed"
    assert insider.ca_key_opens.events() == 0  # the mesh started and served a turn without opening it
    ca = x509.load_pem_x509_certificate((insider.certs / pki.CA_FILE).read_bytes())
    cfg = insider.mesh.cfg
    stolen: list[Any] = []
    for service in ident.SERVICES:
        trust = service_trust(cfg, service)
        assert trust.tls is not None and trust.verifier is not None
        assert not any(str(p).startswith(str(pki.ca_folder(insider.certs))) for p in trust.tls.paths)
        stolen.append(serialization.load_pem_private_key(trust.tls.current().key, password=None))
        stolen += [k.private for k in trust.verifier.keys.current().keys.values() if k.private is not None]
    assert len(stolen) == len(ident.SERVICES) + 1  # every TLS key, and the gateway's one signing key
    for key in stolen:
        cert, own = _cert_signed_by(key, ca.subject, str(ident.client("evil")))
        credentials = grpc.ssl_channel_credentials((insider.certs / pki.CA_FILE).read_bytes(), own, cert)
        async with grpc.aio.secure_channel(cfg[settings.CHAT_ADDRESS], credentials,
                                           [("grpc.ssl_target_name_override", "chat.chatmesh")]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await chat_pb2_grpc.ChatServiceStub(channel).ListConversations(
                    chat_pb2.ListConversationsRequest(owner_id=insider.users["bob"]), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, type(key).__name__


def _forge(insider: Insider, claims: dict[str, object]) -> str:
    keys = tokens.KeySet.from_json(pki.private_keys_file(insider.certs).read_bytes())
    private = keys.keys[keys.signing_key_id].private
    assert private is not None

    def segment(doc: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

    signing = f"{segment({'alg': 'EdDSA', 'kid': keys.signing_key_id, 'typ': 'chatmesh-owner'})}.{segment(claims)}"
    return f"{signing}.{base64.urlsafe_b64encode(private.sign(signing.encode())).rstrip(b'=').decode()}"


async def chat_refusal(channel: grpc.aio.Channel, owner: str, token: str) -> tuple[grpc.StatusCode, str]:
    try:
        await chat_pb2_grpc.ChatServiceStub(channel).ListConversations(
            chat_pb2.ListConversationsRequest(owner_id=owner), metadata=tokens.metadata_of(token), timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


async def test_a_century_token_and_a_token_replayed_from_another_identity_are_refused(insider: Insider) -> None:
    bob = insider.users["bob"]
    now = int(time.time())
    century = _forge(insider, {"sub": bob, "azp": ident.GATEWAY, "iat": now, "exp": now + 100 * 365 * 86400})
    async with insider.chat(ident.GATEWAY) as gateway:
        code, details = await chat_refusal(gateway, bob, century)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "longer than CHATMESH_OWNER_TOKEN_TTL_S" in details
    alice = insider.users["alice"]
    issued = (await insider.issue(ident.client("dev"), owner_id=alice)).token
    async with insider.chat(ident.client("dev")) as dev:
        assert (await chat_refusal(dev, alice, issued))[0] == grpc.StatusCode.OK
    for replayer in (ident.GATEWAY, ident.client("reports")):
        async with insider.chat(replayer) as channel:
            code, details = await chat_refusal(channel, alice, issued)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "minted for spiffe://chatmesh/client/dev" in details


async def test_issue_owner_token_without_a_grant_or_for_an_unknown_owner_is_refused(insider: Insider) -> None:
    for who, owner, why in ((ident.client("reports"), insider.users["alice"], "has no owner-token grant"),
                            (ident.client("dev"), "mallory", "does not cover owner 'mallory'"),
                            (ident.client("dev"), insider.users["bob"], "does not cover owner")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await insider.issue(who, owner_id=owner)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and why in (err.value.details() or "")
    log = (insider.mesh.log_dir / "gateway.log").read_text()
    refused = [json.loads(line) for line in log.splitlines() if '"owner_token_refused"' in line]
    assert {r["reason"] for r in refused} == {"no_grant", "owner_not_granted"}


async def test_six_turns_over_the_grants_budget_from_an_internal_client_spend_nothing(insider: Insider) -> None:
    alice = insider.users["alice"]
    issued = await insider.issue(ident.client("dev"), owner_id=alice)
    assert issued.prompt_token_allowance == 600
    as_alice = tokens.metadata_of(issued.token)
    async with insider.chat(ident.client("dev")) as channel:
        chat = chat_pb2_grpc.ChatServiceStub(channel)
        conv = (await chat.CreateConversation(chat_pb2.CreateConversationRequest(owner_id=alice),
                                              metadata=as_alice)).conversation.conversation_id
        sizes = []
        for allowance in (1, 0, 1, 0, 10**6, 1):  # asking for almost none, none (no limit) or plenty
            request = chat_pb2.SendTurnRequest(owner_id=alice, conversation_id=conv, turn_id=str(uuid.uuid4()),
                                               content=LONG, prompt_token_allowance=allowance)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in chat.SendTurn(request, metadata=as_alice):
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailing: Any = err.value.trailing_metadata()
            sizes.append(int(dict(trailing)["chatmesh-prompt-tokens"]))
        usage = await chat.GetUsage(chat_pb2.GetUsageRequest(owner_id=alice, days=1), metadata=as_alice)
        view = await chat.GetConversation(chat_pb2.GetConversationRequest(owner_id=alice, conversation_id=conv),
                                          metadata=as_alice)
    assert min(sizes) > 600 and len(set(sizes)) == 1
    assert sum(d.turns for d in usage.days) == 0 and list(view.messages) == []


async def test_a_bound_token_needs_its_conversation_and_evict_takes_only_the_callers_blocks(
        insider: Insider) -> None:
    alice = insider.users["alice"]
    async with insider.edge("bob") as client:
        bobs = (await client.post("/v1/conversations", json={})).json()["id"]
        assert (await sse_turn(client, bobs, LONG[:2000]))[-1] == "event: turn.completed"
    bound = (await insider.issue(ident.client("dev"), owner_id=alice, conversation_id=str(uuid.uuid4()))).token
    wide = (await insider.issue(ident.client("dev"), owner_id=alice)).token
    engine_address = insider.mesh.cfg[settings.ENGINE_ADDRESS]
    # the presenter is chat, which forwards the tokens its requests carry (the only identity the engine takes)
    async with channel_as(insider.certs, ident.CHAT, engine_address, "engine") as channel:
        engine = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await engine.Generate(generate_pb2.GenerateRequest(owner_id=alice, prompt_token_ids=[1, 2, 3],
                                                               max_tokens=2), metadata=tokens.metadata_of(bound)).read()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "must name it" in (err.value.details() or "")
        evicted = await engine.Evict(generate_pb2.EvictRequest(owner_id=alice, conversation_id=bobs),
                                     metadata=tokens.metadata_of(wide))
        assert evicted.blocks_evicted == 0
    async with insider.edge("bob") as client:  # bob's next turn still finds his prefix cached
        async with client.stream("POST", f"/v1/conversations/{bobs}/turns",
                                 json={"turn_id": str(uuid.uuid4()), "content": "And then?"}) as r:
            events = list(read_sse_lines([line async for line in r.aiter_lines()]))
    completed = next(data for event, data in events if event == "turn.completed")
    assert completed["usage"]["cached_prompt_tokens"] > 0


def read_sse_lines(lines: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    event = ""
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event:
            yield event, json.loads(line.removeprefix("data: "))


async def test_a_wide_body_is_refused_unparsed_and_the_edge_keeps_answering_meanwhile(insider: Insider) -> None:
    wide = '{"turn_id": "%s", "content": "x", "x": [%s]}' % (uuid.uuid4(), ",".join(["[]"] * 1_390_000))
    healthz: list[float] = []
    gaps: list[float] = []
    async with insider.edge("bob") as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        flooding = True

        async def flood() -> int:
            refused = 0
            async with insider.edge("bob") as attacker:
                while flooding:
                    r = await attacker.post(f"/v1/conversations/{conv}/turns", content=wide,
                                            headers={"content-type": "application/json"})
                    assert r.status_code == 413 and "JSON elements" in r.text
                    refused += 1
            return refused

        async def probe() -> None:
            while flooding:
                start = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                healthz.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)

        async def stream() -> None:
            async with client.stream("POST", f"/v1/conversations/{conv}/turns",
                                     json={"turn_id": str(uuid.uuid4()), "content": LONG[:400]}) as r:
                last = time.perf_counter()
                async for line in r.aiter_lines():
                    if line.startswith("event: turn.delta"):
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now

        attack = asyncio.create_task(flood())
        watch = asyncio.create_task(probe())
        await asyncio.sleep(0.5)
        await stream()
        await asyncio.sleep(1.0)
        flooding = False
        refused = await attack
        await watch
    # Before: each such body held the gateway's loop ~1.2 s (/healthz 1.5 s, streams stalled 2 s). The issue's
    # bound, 100 ms, holds for nine in ten /healthz answers and the typical gap between deltas; the worst of each
    # is bounded loosely (this machine is shared: another process's burst is not the gateway's stall). The
    # figures are printed for the record (BENCHMARKS.md, issue 30).
    print(f"wide bodies refused: {refused}; /healthz p50 {statistics.median(healthz) * 1000:.1f} ms, "
          f"max {max(healthz) * 1000:.1f} ms over {len(healthz)}; stream gap max {max(gaps, default=0) * 1000:.1f} ms")
    assert refused >= 3 and len(healthz) >= 10 and gaps
    assert sum(h < 0.1 for h in healthz) >= 0.9 * len(healthz) and statistics.median(gaps) < 0.1, (healthz, gaps)
    assert max(healthz) < 1.0 and max(gaps) < 1.0


async def test_forwarded_for_from_loopback_is_not_believed_and_a_public_gateway_refuses_the_dev_pepper(
        insider: Insider, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=insider.mesh.gateway_url, timeout=30) as anonymous:
        codes = [(await anonymous.get("/v1/conversations", headers={"x-forwarded-for": f"203.0.113.{i}"})).status_code
                 for i in range(6)]
    assert codes == [401] * 5 + [429]  # one budget: the TCP peer's, whatever address each request claims
    env = {**os.environ, **insider.mesh.env, "CHATMESH_PUBLIC_ORIGIN": "https://chat.example.com",
           "CHATMESH_GATEWAY_PORT": "0", "CHATMESH_GATEWAY_METRICS_PORT": "0", "CHATMESH_OWNER_TOKEN_ADDRESS": ""}
    env.pop("CHATMESH_KEY_PEPPER", None)
    done = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "gateway"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "startup_refused" in done.stderr and "CHATMESH_KEY_PEPPER" in done.stderr
    assert "CHATMESH_PUBLIC_ORIGIN=https://chat.example.com" in done.stderr


# One RPC per service port of the running mesh, each open to some mesh identity (chat.proto and the others'
# authorization tables): what an outsider would try first.
PROBED = {"chat": (settings.CHAT_ADDRESS, "/chatmesh.v1.ChatService/ListConversations"),
          "store": (settings.STORE_ADDRESS, "/chatmesh.v1.StoreService/ReadUsage"),
          "router": (settings.ROUTER_ADDRESS, "/chatmesh.v1.RouteService/ListReplicas"),
          "engine": (settings.ENGINE_ADDRESS, "/chatmesh.v1.GenerateService/GetStats"),
          "moderation": (settings.MODERATION_ADDRESS, "/chatmesh.v1.ModerateService/CheckInput"),
          "gateway": (settings.OWNER_TOKEN_ADDRESS, "/chatmesh.v1.OwnerTokenService/IssueOwnerToken")}


async def _probe(channel: grpc.aio.Channel, path: str) -> tuple[grpc.StatusCode, str]:
    """One call with an empty request."""
    async with channel:
        try:
            await channel.unary_unary(path, None, None)(b"", timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


async def test_the_outsider_probes_get_nothing_from_any_port_of_the_running_mesh(
        insider: Insider, tmp_path: Path) -> None:
    """Plaintext, no certificate, a foreign CA's certificate: no handshake (UNAVAILABLE); the mesh CA's own
    certificates out of their validity window (expired, not yet valid): no handshake either; in it but naming
    another trust domain or a made-up service: denied by name. Every service's port, the gateway's too."""
    ca_pem = (insider.certs / pki.CA_FILE).read_bytes()
    authority = pki.load_authority(insider.certs)
    assert authority is not None
    pki.ensure(tmp_path / "foreign" / "certs")
    foreign = pki.load_authority(tmp_path / "foreign" / "certs")
    assert foreign is not None
    now = datetime.datetime.now(datetime.timezone.utc)

    def signed(ca: pki.Authority, who: str, start: datetime.datetime | None = None) -> grpc.ChannelCredentials:
        cert, key = _cert_signed_by(ca.key, ca.cert.subject, who, start=start)
        return grpc.ssl_channel_credentials(ca_pem, key, cert)

    operator = str(ident.OPERATOR)
    probes: list[tuple[str, grpc.ChannelCredentials | None, grpc.StatusCode]] = [
        ("plaintext", None, grpc.StatusCode.UNAVAILABLE),
        ("no certificate", grpc.ssl_channel_credentials(ca_pem), grpc.StatusCode.UNAVAILABLE),
        ("a foreign CA", signed(foreign, operator), grpc.StatusCode.UNAVAILABLE),
        ("expired", signed(authority, operator, now - datetime.timedelta(days=2)), grpc.StatusCode.UNAVAILABLE),
        ("not yet valid", signed(authority, operator, now + datetime.timedelta(days=1)), grpc.StatusCode.UNAVAILABLE),
        ("another trust domain", signed(authority, "spiffe://other/chat"), grpc.StatusCode.PERMISSION_DENIED),
        ("a made-up service", signed(authority, "spiffe://chatmesh/billing"), grpc.StatusCode.PERMISSION_DENIED),
    ]
    for service, (setting, path) in PROBED.items():
        address = insider.mesh.cfg[setting]
        name = [("grpc.ssl_target_name_override", ident.server_name(service))]
        for what, credentials, expected in probes:
            channel = grpc.aio.insecure_channel(address) if credentials is None else \
                grpc.aio.secure_channel(address, credentials, name)
            code, details = await _probe(channel, path)
            assert code == expected, (service, what, code, details)
            if expected == grpc.StatusCode.PERMISSION_DENIED:
                assert f"may not call {path}" in details, (service, what, details)
        # the control: the same port lets a mesh identity its table admits past the handshake and the table
        allowed = ident.client("dev") if service in ("chat", "gateway") else \
            ident.OPERATOR if service in ("router", "engine") else ident.CHAT
        code, details = await _probe(channel_as(insider.certs, allowed, address, service), path)
        assert code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED), (service, code, details)


async def test_a_grant_added_to_the_file_mints_and_one_taken_out_stops_minting_without_a_restart(
        insider: Insider) -> None:
    """The operator's revocation: the gateway re-reads the authorization file's grants within a second of a change
    (tokens already minted live out their TTL, at most CHATMESH_OWNER_TOKEN_TTL_S)."""
    path = Path(insider.mesh.env["CHATMESH_MESH_AUTHZ_FILE"])
    reports, bob = ident.client("reports"), insider.users["bob"]

    def write(doc: dict[str, Any]) -> None:
        staged = path.with_suffix(".new")
        staged.write_text(json.dumps(doc))
        staged.replace(path)

    async def refusal() -> grpc.StatusCode:
        try:
            await insider.issue(reports, owner_id=bob)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    assert await refusal() == grpc.StatusCode.PERMISSION_DENIED
    granted = {**GRANTS["owner_token_grants"], str(reports): {"owners": ["bob"], "scopes": ["read"]}}
    try:
        write({"owner_token_grants": granted})
        for want in (grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED):
            for _ in range(50):
                if (code := await refusal()) == want:
                    break
                await asyncio.sleep(0.1)
            assert code == want
            write(GRANTS)  # taken out again
    finally:
        write(GRANTS)
    assert (await insider.issue(ident.client("dev"), owner_id=insider.users["alice"])).token  # dev's grant held


async def test_a_retired_keys_token_is_refused_though_chat_verified_it_before(insider: Insider) -> None:
    """Last: it retires the signing key the others' tokens were minted with."""
    alice = insider.users["alice"]
    issued = await insider.issue(ident.client("dev"), owner_id=alice)
    async with insider.chat(ident.client("dev")) as dev:
        assert (await chat_refusal(dev, alice, issued.token))[0] == grpc.StatusCode.OK  # now in chat's cache
        new_kid = pki.rotate_token_key(insider.certs, retire=[issued.key_id])
        for _ in range(50):  # chat looks at its key file at most once a second
            code, details = await chat_refusal(dev, alice, issued.token)
            if code != grpc.StatusCode.OK:
                break
            await asyncio.sleep(0.1)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "retired key" in details, (code, details)
        for _ in range(50):  # the gateway signs with the new key once it has read its file
            fresh = await insider.issue(ident.client("dev"), owner_id=alice)
            if fresh.key_id == new_kid:
                break
            await asyncio.sleep(0.1)
        assert fresh.key_id == new_kid
        assert (await chat_refusal(dev, alice, fresh.token))[0] == grpc.StatusCode.OK
