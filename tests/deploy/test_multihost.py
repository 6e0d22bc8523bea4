"""The sim overlay's mesh across hosts: every pod on a host of its own (a network namespace on a bridge, netns.py),
started with the command and environment the rendered manifests give its container (pods.py), mutual TLS on with
certificates from `chatmesh certs`, PostgreSQL and Redis on hosts of their own, names resolved through each
host's /etc/hosts as the cluster's DNS would resolve the Services.

Pods: one per Deployment behind a ClusterIP Service (gateway, store, router, moderation, redis: this test has no
kube-proxy to spread a virtual IP over several), every replica the manifests ask for behind a headless Service
(chat x 2, which the gateways balance by DNS, and the engine StatefulSet's 3, which the router finds by DNS), the
migrations Job, and one PostgreSQL instance of the CloudNativePG Cluster. The test is the client: the root
namespace, on the same bridge, talks HTTP to the gateway's address.

The scenario: turns through the gateway, each crossing the gateway, chat, store, router, moderation and engine
hosts (their RPC counters say so); then the engine host generating a turn vanishes mid-reply (its switch port
down first, then its process killed by pid, so no FIN or RST ever reaches its peers: only the mesh's gRPC
keepalive, chatmesh.mesh.channels, tells chat and the router it is gone, within ~8 s): the client retries that turn with the same turn id, the conversations that
lived there spill to the other engines, and the store holds every turn the client saw completed exactly once;
then the host comes back (port up, the same pod started again) and the router serves it again (ListReplicas as
the operator, and a new conversation's turn generated there). Through it all every pod read every setting its
manifest gave it (no settings_unread warning) and logged no error.

Needs root, iproute2, PostgreSQL's server binaries, redis-server and kubectl; skips naming what is missing (fails
with CHATMESH_REQUIRE_SERVICES=1). Every wait is bounded; the network, its hosts and /etc/netns/<ns> are removed
even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from chatmesh.v1 import route_pb2, route_pb2_grpc
from tests.conftest import need
from tests.deploy import netns, pods
from tests.deploy.manifests import K8S, Obj, find, kubectl, pod_labels, pod_spec, render, serve_target, workloads
from tests.deploy.netns import Host, Network
from tests.deploy.pods import Postgres, SecretFiles, Started
from tests.e2e.conftest import SseEvent, read_sse

pytestmark = pytest.mark.timeout(300)

START_S = 90.0  # every pod ready within this (a loaded two-core machine starts ten Python processes)
RETRY_S = 45.0  # the in-flight turn completes on another engine within this, retried by the client
USERS = ("alice", "bob", "carol")  # owners enough to stay under the per-user turn limit


def _wait(what: str, done: Callable[[], bool], timeout_s: float, every_s: float = 0.2,
          detail: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s {detail()}")


@dataclass
class Cluster:
    net: Network
    objs: list[Obj]
    pods_dir: Path
    certs: Path
    secret_files: SecretFiles
    pg: Postgres
    hosts: dict[str, Host] = field(default_factory=dict)  # pod name -> its host
    running: dict[str, Started] = field(default_factory=dict)  # pod name -> its container
    keys: dict[str, str] = field(default_factory=dict)  # user -> API key

    def workload(self, pod: str) -> Obj:
        base = pod.rsplit("-", 1)[0]
        return next(w for w in workloads(self.objs) if w["metadata"]["name"] in (pod, base))

    def start(self, pod: str) -> Started:
        started = pods.start(self.net, self.hosts[pod], self.workload(pod), pod, self.secret_files, self.pods_dir)
        self.running[pod] = started
        return started

    def wait_ready(self, names: list[str], timeout_s: float = START_S) -> None:
        def all_ready() -> bool:
            for name in names:
                s = self.running[name]
                if s.proc.poll() is not None:
                    raise AssertionError(f"{name} exited ({s.proc.returncode}):\n{tail(s.log)}")
            return all(pods.ready(self.running[n].container, self.hosts[n].ip) for n in names)
        _wait(f"pods {names} ready", all_ready, timeout_s, every_s=0.5)

    def exec(self, pod: str, argv: list[str]) -> str:
        out = pods.run_to_end(self.net, self.hosts[pod], self.workload(pod), pod, self.secret_files, self.pods_dir,
                              argv=argv)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def port(self, pod: str, name: str) -> int:
        ports = pod_spec(self.workload(pod))["containers"][0]["ports"]
        return int(next(p["containerPort"] for p in ports if p["name"] == name))

    def gateway_url(self) -> str:
        return f"http://{self.hosts['gateway-0'].ip}:{self.port('gateway-0', 'http')}"


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def pod_names(objs: list[Obj]) -> dict[str, Obj]:
    """pod name -> workload: every StatefulSet replica and headless Deployment replica, one of any other."""
    headless = {tuple(sorted(s["spec"]["selector"].items())) for s in objs
                if s["kind"] == "Service" and s["spec"].get("clusterIP") == "None"}
    out: dict[str, Obj] = {}
    for w in workloads(objs):
        name = w["metadata"]["name"]
        if w["kind"] == "Job":
            out[name] = w
            continue
        behind_headless = any(set(dict(sel).items()) <= set(pod_labels(w).items()) for sel in headless)
        count = w["spec"].get("replicas", 1) if behind_headless else 1
        for i in range(count):
            out[f"{name}-{i}"] = w
    return out


def dns_names(objs: list[Obj], pods_of: dict[str, Obj]) -> dict[str, list[str]]:
    """pod name -> the names the cluster's DNS gives it: its Services' (every pod of a headless one), or for a
    StatefulSet pod its own `<pod>.<service>` only; each also fully qualified (`<name>.<namespace>.svc.cluster.
    local`). The set-wide name of a StatefulSet's Service is left out: gRPC's resolver (c-ares) reading a hosts
    file merges the lines that share a name, so `engine-0.engine` would answer with every engine's address
    (cluster DNS keeps the records apart; nothing in the manifests dials the set-wide name)."""
    names: dict[str, list[str]] = {pod: [] for pod in pods_of}
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = set(svc["spec"].get("selector", {}).items())
        for pod, w in pods_of.items():
            if w["kind"] != "Job" and selector and selector <= set(pod_labels(w).items()):
                if w["kind"] != "StatefulSet":
                    names[pod].append(svc["metadata"]["name"])
                elif w["spec"]["serviceName"] == svc["metadata"]["name"]:
                    names[pod].append(f"{pod}.{svc['metadata']['name']}")
    namespace = next(o["metadata"]["name"] for o in objs if o["kind"] == "Namespace")
    return {pod: [*ns, *(f"{n}.{namespace}.svc.cluster.local" for n in ns)] for pod, ns in names.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    need(kubectl() is not None, "kubectl (its built-in kustomize renders deploy/k8s)")
    reason = netns.unusable()
    need(reason is None, f"Linux network namespaces ({reason})")
    need(pods.postgres_bin() is not None and shutil.which("setpriv") is not None, "PostgreSQL's server binaries")
    need(shutil.which("redis-server") is not None, "redis-server")
    objs = render(K8S / "overlays" / "sim")
    tmp = tmp_path_factory.mktemp("multihost")
    pg_folder = Path(tempfile.mkdtemp(prefix="chatmesh-multihost-pg-"))  # the postgres user must reach it
    net = Network()
    try:
        net.open()
        yield _bring_up(net, objs, tmp, pg_folder)
    finally:
        net.close()
        shutil.rmtree(pg_folder, ignore_errors=True)
        assert net.leftovers() == []


def _bring_up(net: Network, objs: list[Obj], tmp: Path, pg_folder: Path) -> Cluster:
    pods_of = pod_names(objs)
    names = dns_names(objs, pods_of)
    cnpg = find(objs, "Cluster", "chatmesh-pg")
    certs = tmp / "certs"  # the operator's development PKI, as the README makes it
    made = subprocess.run([str(pods.VENV_BIN / "chatmesh"), "certs", "--data-dir", str(tmp)], capture_output=True,
                          text=True, timeout=60, env={"PATH": f"{pods.VENV_BIN}:/usr/bin:/bin"})
    assert made.returncode == 0, made.stderr
    secret_files = pods.make_secrets(objs, certs)
    pods_dir = tmp / "pods"
    pods_dir.mkdir()
    namespace = next(o["metadata"]["name"] for o in objs if o["kind"] == "Namespace")
    pg_name = f"{cnpg['metadata']['name']}-rw"  # CloudNativePG's Service for the primary
    pg_host = net.add_host("pg", [pg_name, f"{pg_name}.{namespace}.svc.cluster.local"])
    with (pods_dir / "postgres.log").open("ab") as log:
        pg = pods.start_postgres(net, pg_host, cnpg, secret_files, pg_folder, log)
    c = Cluster(net, objs, pods_dir, certs, secret_files, pg)
    for pod in pods_of:
        c.hosts[pod] = net.add_host(pod, names[pod])
    net.publish_names()
    _wait("PostgreSQL accepting connections", lambda: _pg_up(c), 30)
    pods.bootstrap_database(net, pg, cnpg, secret_files)

    services = [p for p in pods_of if p != "store-migrate"]
    early = [p for p in services if serve_target(pod_spec(pods_of[p])["containers"][0]) in
             ("engine", "router", "moderation", None)]  # None: redis
    for pod in early:
        c.start(pod)
    migrated = pods.run_to_end(net, c.hosts["store-migrate"], pods_of["store-migrate"], "store-migrate",
                               secret_files, pods_dir, timeout_s=90)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    for user in USERS:  # what an operator runs in a gateway pod (kubectl exec)
        c.exec("gateway-0", ["chatmesh", "users", "create", user])
        c.keys[user] = c.exec("gateway-0", ["chatmesh", "keys", "create", user]).strip().splitlines()[-1]
    for pod in services:
        if pod not in early:
            c.start(pod)
    c.wait_ready(services)
    _wait("the router sees every engine serving", lambda: _serving(c) == _engines(c), 30)
    return c


def _pg_up(c: Cluster) -> bool:
    with contextlib.suppress(RuntimeError):
        return c.pg.psql(c.net, "postgres", "SELECT 1").strip() == "1"
    return False


def _engines(c: Cluster) -> set[str]:
    return {p for p in c.hosts if p.startswith("engine-")}


# ---- the client's side: the gateway over HTTP, the router as the operator ------------------------------------

def replicas(c: Cluster) -> list[route_pb2.ReplicaStatus]:
    """RouteService/ListReplicas as the operator identity, over mTLS to the router's address."""
    creds = grpc.ssl_channel_credentials((c.certs / "ca.pem").read_bytes(), (c.certs / "operator-key.pem").read_bytes(),
                                         (c.certs / "operator.pem").read_bytes())
    target = f"{c.hosts['router-0'].ip}:{c.port('router-0', 'grpc')}"
    with grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", "router.chatmesh")]) as ch:
        resp = route_pb2_grpc.RouteServiceStub(ch).ListReplicas(route_pb2.ListReplicasRequest(), timeout=5)
    return list(resp.replicas)


def _serving(c: Cluster) -> set[str]:
    return {r.replica_id for r in replicas(c) if r.state == route_pb2.REPLICA_STATE_SERVING}


def handled(c: Cluster, pod: str) -> float:
    """RPCs the pod's service has answered (chatmesh_rpc_server_handled_total over every method), from its
    Prometheus port on its own address."""
    text = httpx.get(f"http://{c.hosts[pod].ip}:{c.port(pod, 'metrics')}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("chatmesh_rpc_server_handled_total{"))


def client(c: Cluster, user: str) -> httpx.Client:
    return httpx.Client(base_url=c.gateway_url(), timeout=30, headers={"authorization": f"Bearer {c.keys[user]}"})


def new_conversation(http: httpx.Client) -> str:
    resp = http.post("/v1/conversations", json={})
    assert resp.status_code == 201, resp.text
    conv: str = resp.json()["id"]
    return conv


def send(http: httpx.Client, conv: str, turn: str, content: str,
         on_delta: Callable[[], None] | None = None) -> list[SseEvent]:
    """One attempt at a turn; `on_delta` runs once, at its first delta (while the reply is still streaming)."""
    events = []
    with http.stream("POST", f"/v1/conversations/{conv}/turns", json={"turn_id": turn, "content": content}) as resp:
        assert resp.status_code == 200, resp.read()
        for event in read_sse(resp):
            events.append(event)
            if event.event == "turn.delta" and on_delta is not None:
                on_delta()
                on_delta = None
    return events


def until_stored(http: httpx.Client, conv: str, turn: str, content: str, timeout_s: float = RETRY_S
                 ) -> tuple[SseEvent, int]:
    """Retries the turn with the same turn id (as a client does after a retryable failure or a cut stream)
    until it completes; returns turn.completed and the number of attempts after the first."""
    deadline, retries = time.monotonic() + timeout_s, 0
    while True:
        with contextlib.suppress(httpx.TransportError):
            events = send(http, conv, turn, content)
            if events and events[-1].event == "turn.completed":
                return events[-1], retries
            assert not events or events[-1].event == "turn.failed" and events[-1].data["retryable"], events[-1:]
        assert time.monotonic() < deadline, f"turn {turn} not stored within {timeout_s:.0f} s"
        retries += 1
        time.sleep(0.5)


@dataclass
class Sent:
    user: str
    conv: str
    turns: list[str] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)


def new_sent(c: Cluster, user: str) -> Sent:
    with client(c, user) as http:
        return Sent(user, new_conversation(http))


def turn(c: Cluster, sent: Sent, content: str) -> str:
    """A turn that must complete at the first attempt; returns the replica that generated it."""
    with client(c, sent.user) as http:
        tid = str(uuid.uuid4())
        events = send(http, sent.conv, tid, content)
    assert events[-1].event == "turn.completed", events[-1:]
    sent.turns.append(tid)
    replica: str = events[-1].data["replica_id"]
    sent.replicas.append(replica)
    return replica


def stored(c: Cluster) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """turn id -> (its turn record's state, its messages as (role, status)), read from PostgreSQL directly."""
    out: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for line in c.pg.psql(c.net, "chatmesh", "SELECT turn_id, state FROM turns").splitlines():
        tid, state = line.split("|")
        out[tid] = (state, [])
    for line in c.pg.psql(c.net, "chatmesh", "SELECT turn_id, role, status FROM messages").splitlines():
        tid, role, status = line.split("|")
        out.setdefault(tid, ("(no turn record)", []))[1].append((role, status))
    return out


# ---- the test ------------------------------------------------------------------------------------------------

def test_the_certificates_name_what_the_manifests_certificates_name(cluster: Cluster) -> None:
    for cert in (o for o in cluster.objs if o["kind"] == "Certificate" and not o["spec"].get("isCA")):
        files = cluster.secret_files[cert["spec"]["secretName"]]
        uris, dns = pods.certificate_names(files["tls.crt"])
        assert (uris, dns) == (cert["spec"]["uris"], cert["spec"]["dnsNames"]), cert["metadata"]["name"]


def test_turns_cross_hosts_and_losing_an_engine_host_loses_and_duplicates_nothing(cluster: Cluster) -> None:
    c = cluster
    turn_pods = ["chat-0", "chat-1", "store-0", "router-0", "moderation-0", *sorted(_engines(c))]

    # 1. One turn crosses the hosts: the pods whose services answered RPCs for it.
    first = new_sent(c, USERS[0])
    before = {p: handled(c, p) for p in turn_pods}
    replica = turn(c, first, "Hello from another host. Who are you?")
    crossed: set[str] = set()

    def every_hop_counted() -> bool:  # a stream's RPC is counted when it ends, just after the client's last event
        crossed.update(p for p in turn_pods if handled(c, p) > before[p])
        return {"store-0", "router-0", "moderation-0", replica} <= crossed and bool(crossed & {"chat-0", "chat-1"})

    _wait("RPCs of the turn answered on every host", every_hop_counted, 10, detail=lambda: sorted(crossed))
    hosts_crossed = {c.hosts[p].netns for p in crossed} | {c.hosts["gateway-0"].netns}
    assert len(hosts_crossed) >= 4, hosts_crossed

    # 2. Conversations spread over the engines.
    convs = [first]
    for i in range(5):
        user = USERS[(i + 1) % len(USERS)]
        convs.append(new_sent(c, user))
        turn(c, convs[-1], f"Conversation {i}: tell me about network namespaces.")
    homes = {s.conv: s.replicas[-1] for s in convs}

    # 3. A second turn of the first conversation; at its first delta, its engine's host is taken away.
    victim: list[str] = []

    def take_the_host_away() -> None:
        busy = [r.replica_id for r in replicas(c) if r.open_leases > 0]
        assert len(busy) == 1, busy
        victim.append(busy[0])
        host = c.hosts[busy[0]]
        c.net.unplug(host)  # first: the host vanishes silently, no FIN or RST leaves it
        c.net.kill(host)

    tid = str(uuid.uuid4())
    content = "And what happens when a host goes away mid-reply?"
    with client(c, first.user) as http:
        attempt = send(http, first.conv, tid, content, on_delta=take_the_host_away)
        assert victim, "the reply ended before its first delta"
        assert attempt[-1].event == "turn.failed" and attempt[-1].data["retryable"], attempt[-1:]
        completed, retries = until_stored(http, first.conv, tid, content)
    lost = victim[0]
    assert completed.data["replica_id"] != lost
    first.turns.append(tid)
    first.replicas.append(completed.data["replica_id"])

    # 4. The lost engine's conversations spill: their next turns complete on the others.
    _wait(f"the router taking {lost} out", lambda: lost not in _serving(c), 10)
    for s in convs:
        if homes[s.conv] == lost and s is not first:
            assert turn(c, s, "Still there?") != lost

    # 5. The store holds every turn the client saw completed exactly once (a user message and a reply), and
    #    nothing else.
    rows = stored(c)
    sent_turns = [t for s in convs for t in s.turns]
    assert sorted(rows) == sorted(sent_turns)
    for t in sent_turns:
        state, messages = rows[t]
        assert state == "stored" and sorted(messages) == [("assistant", "complete"), ("user", "complete")], \
            (t, state, messages)

    # 6. The host comes back: port up, the same pod started again; the router serves it again.
    c.net.plug(c.hosts[lost])
    c.start(lost)
    c.wait_ready([lost])
    _wait(f"the router serving {lost} again", lambda: lost in _serving(c), 30, detail=lambda: replicas(c))
    landed = []
    for i in range(20):  # new conversations go to the least loaded, ties in each one's ring walk: 1 in 3 here
        s = new_sent(c, USERS[i % len(USERS)])
        landed.append(turn(c, s, f"Welcome back, conversation {i}."))
        if landed[-1] == lost:
            break
    assert lost in landed, landed

    # 7. Every pod read every setting its manifest gave it (no settings_unread warning), and none logged an error
    #    (the turn the lost engine cut off is a warning: failed, retryable).
    for started in c.running.values():
        if serve_target(started.container):
            events = [json.loads(line) for line in started.log.read_text().splitlines() if line.startswith("{")]
            assert [e for e in events if e.get("level") == "error" or
                    e.get("event") == "settings_unread" and e.get("level") == "warning"] == [], started.pod
    print(f"lost {lost}; in-flight turn retried {retries}x, completed on {completed.data['replica_id']}; "
          f"homes {sorted(homes.values())}; after return {landed}")
