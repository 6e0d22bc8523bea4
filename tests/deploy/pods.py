"""The rendered manifests' pods as processes on network-namespace hosts (netns.py): what the kubelet would do with
each container, done by hand.

- Secrets: what the cluster's operators put there. cert-manager's `chatmesh-tls-<service>` (tls.crt, tls.key,
  ca.crt) come from `chatmesh certs` (the development PKI names the same SPIFFE URI and DNS SANs as the
  Certificate objects: `certificate_names` lets the test compare them), the owner-token key files from the same
  folder, CloudNativePG's `chatmesh-pg-app` username from the Cluster's bootstrap owner, every other key a random
  value made here. `needed_secrets` lists what the manifests reference, so nothing is written twice.
- Volumes: the pod's file system is a folder; a Secret volume's keys become files under its mount path there, an
  emptyDir an empty folder. Environment values naming a path under a mount are moved under the pod's folder (the
  only change to the manifests' environment: a container sees /etc/chatmesh/tls/ca.crt, this process
  <pod>/etc/chatmesh/tls/ca.crt).
- The image: the environment and working folder are the Containerfile's final stage's (deploy/image, read by
  containerfile.py), with the image's own folders standing for this machine's (`STAND_INS`: its virtual
  environment is this one, its baked model folder the one `./dev setup` fetched into); its HOME and WORKDIR,
  /var/lib/chatmesh, is a volume of every pod, so under the pod's folder like any mount.
- Probes: `ready` runs the container's readinessProbe (gRPC health on the plaintext health port, an HTTP GET, a
  TCP connect) against the pod's address, as the kubelet does.
"""

from __future__ import annotations

import os
import re
import secrets as random_secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
import httpx
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.mesh import pki
from chatmesh.model import settings as model_settings
from tests.deploy.containerfile import CONTAINERFILE, stages
from tests.deploy.manifests import Obj, Pod, command, container_env, find, pod_spec, workloads
from tests.deploy.netns import Host, Network

VENV_BIN = Path(sys.executable).parent
MODEL_DIR = os.path.expanduser(os.environ.get(model_settings.MODEL_DIR.env, model_settings.MODEL_DIR.default))
STAND_INS = {"/opt/chatmesh/venv": str(VENV_BIN.parent), "/opt/chatmesh/models": MODEL_DIR}  # image -> here


def image() -> tuple[dict[str, str], str]:
    """(ENV, WORKDIR) of the image's final stage, its folders replaced by their stand-ins here."""
    final = stages(CONTAINERFILE.read_text())[1][-1]
    env = {k: _stand_in(v) for k, v in final.env.items()}
    return env, final.last("WORKDIR") or "/"


def _stand_in(value: str) -> str:
    for there, here in STAND_INS.items():
        value = value.replace(there, here)
    return value
SecretFiles = dict[str, dict[str, bytes]]  # secret name -> key -> value


def needed_secrets(objs: list[Obj]) -> set[tuple[str, str | None]]:
    """(secret, key) of every secretKeyRef, and (secret, None) of every Secret volume, the workloads use."""
    needed: set[tuple[str, str | None]] = set()
    for w in workloads(objs):
        spec = pod_spec(w)
        needed |= {(v["secret"]["secretName"], None) for v in spec.get("volumes", []) if "secret" in v}
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            for var in c.get("env", []):
                if ref := var.get("valueFrom", {}).get("secretKeyRef"):
                    needed.add((ref["name"], ref["key"]))
    return needed


def make_secrets(objs: list[Obj], certs: Path) -> SecretFiles:
    """Every Secret the manifests reference, with the keys they read (see the module header)."""
    owner = find(objs, "Cluster", "chatmesh-pg")["spec"]["bootstrap"]["initdb"]["owner"]
    known: SecretFiles = {
        "chatmesh-owner-token-keys": {"owner-token-keys.json": pki.private_keys_file(certs).read_bytes()},
        "chatmesh-owner-token-public-keys": {
            "owner-token-public-keys.json": (certs / "owner-token-public-keys.json").read_bytes()},
        "chatmesh-pg-app": {"username": owner.encode(), "password": random_secrets.token_hex(16).encode()},
    }
    out: SecretFiles = {}
    for name, key in sorted(needed_secrets(objs), key=lambda nk: (nk[0], nk[1] or "")):
        if name.startswith("chatmesh-tls-"):
            stem = name.removeprefix("chatmesh-tls-")
            out[name] = {"tls.crt": (certs / f"{stem}.pem").read_bytes(),
                         "tls.key": (certs / f"{stem}-key.pem").read_bytes(), "ca.crt": (certs / "ca.pem").read_bytes()}
        elif name in known:
            out[name] = known[name]
        elif key is not None:
            out.setdefault(name, {})[key] = random_secrets.token_hex(32).encode()
        else:
            raise KeyError(f"Secret {name} is mounted whole and this test does not know what it holds")
    return out


def certificate_names(pem: bytes) -> tuple[list[str], list[str]]:
    """(URI SANs, DNS SANs) of a certificate, to compare with a cert-manager Certificate's uris and dnsNames."""
    san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier), san.get_values_for_type(x509.DNSName)


@dataclass
class Started:
    """One pod's container running on a host."""

    pod: str
    host: Host
    container: Obj
    env: dict[str, str]
    root: Path
    log: Path
    proc: subprocess.Popen[bytes]


def _relocate(value: str, mounts: list[str], root: Path) -> str:
    for mount in mounts:
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(root) + value
    return value


def executable(word: str, env: Mapping[str, str]) -> str:
    """A command's first word found on the container's PATH (Redis: its own image's, here the machine's)."""
    found = shutil.which(word, path=env["PATH"]) or shutil.which(word)
    if found is None:
        raise FileNotFoundError(f"{word}: not installed (the container image would have it)")
    return found


def environment(workload: Obj, container: Obj, pod_name: str, ip: str, secret_files: SecretFiles, root: Path
                ) -> dict[str, str]:
    """The container's environment with its pod's file system under `root`: its volumes laid out there."""
    values = {(name, key): v.decode() for name, keys in secret_files.items() for key, v in keys.items()}
    env = container_env(container, Pod(pod_name, ip, values))
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    mounts = []
    for m in container.get("volumeMounts", []):
        folder = root / m["mountPath"].lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        mounts.append(m["mountPath"])
        if "secret" in (volume := volumes[m["name"]]):
            for key, data in secret_files[volume["secret"]["secretName"]].items():
                (folder / key).write_bytes(data)
                (folder / key).chmod(volume["secret"].get("defaultMode", 0o644))  # the kubelet's default
    image_env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}  # another image's: only where to find its command
    if ours(container):
        image_env, folder = image()
        mounts.append(folder)  # the image's HOME and WORKDIR, a folder of the pod's own like its mounts
    return {k: _relocate(v, mounts, root) for k, v in {**image_env, **env}.items()}


def ours(container: Obj) -> bool:
    """Whether the container runs chatmesh's image (Redis runs its own)."""
    return bool(re.search(r"(^|/)chatmesh(:[^/]*)?$", container["image"]))


def workdir(container: Obj, root: Path) -> Path:
    """The image's WORKDIR in the pod's file system."""
    folder = root / image()[1].lstrip("/") if ours(container) else root
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def start(net: Network, host: Host, workload: Obj, pod_name: str, secret_files: SecretFiles, pods_dir: Path,
          container_name: str | None = None) -> Started:
    """Starts one container of `workload` as pod `pod_name` on `host` (its log: <pods_dir>/<pod>.log)."""
    containers = pod_spec(workload)["containers"]
    container = next(c for c in containers if container_name in (None, c["name"]))
    root = pods_dir / pod_name
    root.mkdir(parents=True, exist_ok=True)
    env = environment(workload, container, pod_name, host.ip, secret_files, root)
    argv = command(container, env)
    log = pods_dir / f"{pod_name}.log"
    out: IO[bytes]
    with log.open("ab") as out:
        proc = net.spawn(host, [executable(argv[0], env), *argv[1:]], env, workdir(container, root), out)
    return Started(pod_name, host, container, env, root, log, proc)


def run_to_end(net: Network, host: Host, workload: Obj, pod_name: str, secret_files: SecretFiles, pods_dir: Path,
               argv: list[str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """A Job's container run to its end on `host`, or (`argv`) a command run in a pod's container, as
    `kubectl exec` would: with its environment and files."""
    container = pod_spec(workload)["containers"][0]
    root = pods_dir / pod_name
    root.mkdir(parents=True, exist_ok=True)
    env = environment(workload, container, pod_name, host.ip, secret_files, root)
    argv = argv or command(container, env)
    return net.exec(host, [executable(argv[0], env), *argv[1:]], env, workdir(container, root), timeout=timeout_s)


def _port(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == port))


def ready(container: Obj, ip: str, timeout_s: float = 1.0) -> bool:
    """The container's readinessProbe, once, against `ip` (True: it passes)."""
    probe: Mapping[str, Obj] = container["readinessProbe"]
    try:
        if "grpc" in probe:
            target = f"{ip}:{_port(container, probe['grpc']['port'])}"
            with grpc.insecure_channel(target) as channel:
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=str(probe["grpc"].get("service", ""))), timeout=timeout_s)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
        if "httpGet" in probe:
            url = f"http://{ip}:{_port(container, probe['httpGet']['port'])}{probe['httpGet']['path']}"
            return 200 <= httpx.get(url, timeout=timeout_s).status_code < 400
        if "tcpSocket" in probe:
            with socket.create_connection((ip, _port(container, probe["tcpSocket"]["port"])), timeout=timeout_s):
                return True
    except (grpc.RpcError, httpx.HTTPError, OSError):
        return False
    raise ValueError(f"{container['name']}: unsupported readinessProbe {probe}")


# ---- PostgreSQL: what the CloudNativePG operator runs for the Cluster -------------------------------------------

def postgres_bin() -> Path | None:
    """The folder of a PostgreSQL server's binaries (Debian's /usr/lib/postgresql/N/bin, newest first)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]), reverse=True)
    if found:
        return found[0].parent
    on_path = shutil.which("postgres")
    return Path(on_path).resolve().parent if on_path else None


AS_POSTGRES = ["setpriv", "--reuid=postgres", "--regid=postgres", "--clear-groups", "--"]


@dataclass
class Postgres:
    host: Host
    folder: Path  # owned by the postgres user, outside root-only temporary folders
    bin: Path

    @property
    def socket_dir(self) -> Path:
        return self.folder / "run"

    def psql(self, net: Network, database: str, sql: str) -> str:
        """Rows of `sql` as psql's unaligned output, run as the superuser on the database's own host."""
        out = net.exec(self.host, [*AS_POSTGRES, str(self.bin / "psql"), "-h", str(self.socket_dir), "-U", "postgres",
                                   "-d", database, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql], timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"psql: {out.stderr.strip()}")
        return out.stdout


def start_postgres(net: Network, host: Host, cluster: Obj, secret_files: SecretFiles, folder: Path, log: IO[bytes]
                   ) -> Postgres:
    """One instance of the Cluster: initdb, listening on the host's address with password authentication, the
    bootstrap database and owner made with the app Secret's password (as the operator's initdb bootstrap does)."""
    pg_bin = postgres_bin()
    assert pg_bin is not None
    pg = Postgres(host, folder, pg_bin)
    shutil.chown(folder, "postgres", "postgres")
    folder.chmod(0o700)
    data = folder / "data"
    subprocess.run([*AS_POSTGRES, str(pg_bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth-local=trust",
                    "--auth-host=scram-sha-256", "-N", "-E", "UTF8"], check=True, capture_output=True, timeout=60)
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write("host all all 0.0.0.0/0 scram-sha-256\n")
    pg.socket_dir.mkdir()
    shutil.chown(pg.socket_dir, "postgres", "postgres")
    params = {**cluster["spec"]["postgresql"].get("parameters", {}), "listen_addresses": "*", "port": "5432",
              "unix_socket_directories": str(pg.socket_dir), "fsync": "off"}
    net.spawn(host, [*AS_POSTGRES, str(pg_bin / "postgres"), "-D", str(data),
                     *(f"-c{k}={v}" for k, v in params.items())], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
              folder, log)
    return pg


def bootstrap_database(net: Network, pg: Postgres, cluster: Obj, secret_files: SecretFiles) -> None:
    initdb = cluster["spec"]["bootstrap"]["initdb"]
    app = secret_files["chatmesh-pg-app"]
    assert app["username"].decode() == initdb["owner"]
    pg.psql(net, "postgres", f"CREATE ROLE {initdb['owner']} LOGIN PASSWORD '{app['password'].decode()}'")
    pg.psql(net, "postgres", f"CREATE DATABASE {initdb['database']} OWNER {initdb['owner']}")
