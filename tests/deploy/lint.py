"""Rules the rendered manifests keep beyond their schemas; each returns what breaks it, as lines naming the object.

- images: a tag, never `latest` (or none);
- probes: every long-running container has readiness and liveness probes; a chatmesh gRPC service's probes use
  its plaintext health port (CHATMESH_HEALTH_PORT), since the probes carry no client certificate;
- resources: every container requests CPU and memory and has a memory limit;
- drain: terminationGracePeriodSeconds covers the preStop pause plus CHATMESH_SHUTDOWN_GRACE_S (and not by more
  than 10 s), so SIGKILL never cuts a drain the service would have finished;
- availability: gateway and chat run at least 2 replicas; every Deployment and StatefulSet has a
  PodDisruptionBudget;
- secrets: the secrets a service guards (mesh/secrets_guard.py), database URLs and passwords come from Secrets,
  never a literal; every CHATMESH_* name is a setting chatmesh declares;
- keys apart (issue 30): no workload mounts or reads the mesh CA's Secret (cert-manager alone holds its key);
  the owner-token signing keys reach the gateway alone; each `chatmesh-tls-<service>` only that service's pods;
  every Secret volume holding a private key is mounted without read access for other users (defaultMode), since
  a service refuses a key every user may read (mesh/trust.py);
- network: every set of pods is selected by a NetworkPolicy of its own (not only the namespace-wide deny), for
  ingress and, for chatmesh's pods, egress; `hops()` derives what the policies allow, for the test to compare
  with the design's hops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from chatmesh.mesh.config import all_settings
from chatmesh.mesh.secrets_guard import DEV_SECRETS
from tests.deploy.manifests import Obj, pod_labels, pod_sets, pod_spec, serve_target, workloads

LONG_RUNNING = ("Deployment", "StatefulSet")
MIN_REPLICAS = {"gateway": 2, "chat": 2}
GRACE_SLACK_S = 10


def _name(o: Obj) -> str:
    return f"{o['kind']}/{o['metadata']['name']}"


def _containers(w: Obj, init: bool = True) -> Iterator[Obj]:
    spec = pod_spec(w)
    yield from spec.get("containers", [])
    if init:
        yield from spec.get("initContainers", [])


def _env(c: Obj) -> dict[str, Any]:
    return {v["name"]: v for v in c.get("env", [])}


def images(objs: list[Obj]) -> list[str]:
    out = []
    for w in workloads(objs):
        for c in _containers(w):
            image = c.get("image", "")
            tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
            if "@sha256:" not in image and (not tag or tag == "latest"):
                out.append(f"{_name(w)} {c['name']}: image {image!r} has no pinned tag")
    return out


def probes(objs: list[Obj]) -> list[str]:
    out = []
    for w in workloads(objs):
        if w["kind"] not in LONG_RUNNING:
            continue
        for c in _containers(w, init=False):
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    out.append(f"{_name(w)} {c['name']}: no {probe}")
                elif serve_target(c) not in (None, "gateway"):
                    port = c[probe].get("grpc", {}).get("port")
                    health = _env(c).get("CHATMESH_HEALTH_PORT", {}).get("value")
                    if health is None or str(port) != health:
                        out.append(f"{_name(w)} {c['name']}: {probe} is not a gRPC probe on CHATMESH_HEALTH_PORT "
                                   f"({health})")
    return out


def resources(objs: list[Obj]) -> list[str]:
    out = []
    for w in workloads(objs):
        for c in _containers(w):
            r = c.get("resources", {})
            missing = [f"requests.{k}" for k in ("cpu", "memory") if k not in r.get("requests", {})]
            missing += ["limits.memory"] if "memory" not in r.get("limits", {}) else []
            if missing:
                out.append(f"{_name(w)} {c['name']}: no {', '.join(missing)}")
    return out


def drain(objs: list[Obj]) -> list[str]:
    out = []
    for w in workloads(objs):
        for c in _containers(w, init=False):
            if serve_target(c) is None:
                continue
            grace_var = _env(c).get("CHATMESH_SHUTDOWN_GRACE_S")
            if grace_var is None:
                out.append(f"{_name(w)} {c['name']}: CHATMESH_SHUTDOWN_GRACE_S not set")
                continue
            pause = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            need = pause + float(grace_var["value"])
            have = pod_spec(w).get("terminationGracePeriodSeconds", 30)
            if not need < have <= need + GRACE_SLACK_S:
                out.append(f"{_name(w)}: terminationGracePeriodSeconds {have} does not match the drain "
                           f"({pause} s preStop + {grace_var['value']} s CHATMESH_SHUTDOWN_GRACE_S)")
    return out


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def availability(objs: list[Obj]) -> list[str]:
    out = []
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for w in workloads(objs):
        if w["kind"] not in LONG_RUNNING:
            continue
        app = pod_labels(w).get("app.kubernetes.io/name", "")
        if w["spec"].get("replicas", 1) < MIN_REPLICAS.get(app, 1):
            out.append(f"{_name(w)}: {w['spec'].get('replicas', 1)} replicas, {app} needs {MIN_REPLICAS[app]}")
        if w["spec"].get("replicas", 1) > 1 and not any(_selects(p["spec"]["selector"], pod_labels(w)) for p in pdbs):
            out.append(f"{_name(w)}: no PodDisruptionBudget")
    return out


SECRET_NAMES = {env for envs in DEV_SECRETS.values() for env in envs}


def secrets(objs: list[Obj]) -> list[str]:
    out = []
    declared = {s.env for s in all_settings()}
    for w in workloads(objs):
        for c in _containers(w):
            for name, var in _env(c).items():
                if name.startswith("CHATMESH_") and name not in declared:
                    out.append(f"{_name(w)} {c['name']}: {name} is no chatmesh setting")
                literal = var.get("value", "")
                if (name in SECRET_NAMES or "PASSWORD" in name) and "valueFrom" not in var:
                    out.append(f"{_name(w)} {c['name']}: {name} is a literal, not from a Secret")
                if "://" in literal and "@" in literal and "$(" not in literal.partition("@")[0]:
                    out.append(f"{_name(w)} {c['name']}: {name} carries credentials in the manifest")
    return out


CA_SECRET = "chatmesh-mesh-ca"
SIGNING_KEYS = "chatmesh-owner-token-keys"
PRIVATE_SECRETS = ("chatmesh-tls-", SIGNING_KEYS, CA_SECRET)


def _secret_uses(w: Obj) -> Iterator[tuple[str, Obj | None]]:
    """(Secret name, its volume or None for an env reference) of every Secret a workload's pods reach."""
    spec = pod_spec(w)
    for v in spec.get("volumes", []):
        if "secret" in v:
            yield v["secret"]["secretName"], v
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                yield source["secret"]["name"], None
    for c in _containers(w):
        for var in c.get("env", []):
            if ref := var.get("valueFrom", {}).get("secretKeyRef"):
                yield ref["name"], None
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                yield source["secretRef"]["name"], None


def keys_apart(objs: list[Obj]) -> list[str]:
    out = []
    for w in workloads(objs):
        served = {serve_target(c) for c in _containers(w, init=False)} - {None}
        for name, volume in _secret_uses(w):
            if name == CA_SECRET:
                out.append(f"{_name(w)}: reaches {CA_SECRET}, the CA's key (only cert-manager may)")
            elif name == SIGNING_KEYS and served != {"gateway"}:
                out.append(f"{_name(w)}: reaches {SIGNING_KEYS}, the owner-token signing keys (the gateway's alone)")
            elif name.startswith("chatmesh-tls-") and served != {name.removeprefix("chatmesh-tls-")}:
                out.append(f"{_name(w)}: reaches {name}, another identity's certificate and key")
            if name.startswith(PRIVATE_SECRETS) and volume is not None \
                    and volume["secret"].get("defaultMode", 0o644) & 0o007:
                out.append(f"{_name(w)}: volume {volume['name']} ({name}) lets every user read its private key "
                           f"(defaultMode {volume['secret'].get('defaultMode', 0o644):o})")
    return out


def _policies(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def network_coverage(objs: list[Obj]) -> list[str]:
    out = []
    own = [p for p in _policies(objs) if p["spec"]["podSelector"]]  # not the namespace-wide ones
    for name, labels in pod_sets(objs).items():
        chatmesh = name.split("/")[0] in ("Deployment", "StatefulSet", "Job")
        for direction in ("Ingress", "Egress") if chatmesh else ("Ingress",):
            if not any(direction in p["spec"].get("policyTypes", []) and _selects(p["spec"]["podSelector"], labels)
                       for p in own):
                out.append(f"{name}: no NetworkPolicy of its own for {direction.lower()}")
    return out


def all_problems(objs: list[Obj]) -> list[str]:
    return [*images(objs), *probes(objs), *resources(objs), *drain(objs), *availability(objs), *secrets(objs),
            *keys_apart(objs), *network_coverage(objs)]


# ---- the hops the NetworkPolicies allow --------------------------------------------------------------------

Hop = tuple[str, str, int]  # (from, to, port): an app name (app.kubernetes.io/name, or postgres) or ns:<name>


def _app(labels: Mapping[str, str]) -> str:
    return "postgres" if "cnpg.io/cluster" in labels else labels.get("app.kubernetes.io/name", "?")


def _ports(objs: list[Obj], labels: Mapping[str, str]) -> dict[str, int]:
    """Named container ports of the pods with `labels` (CloudNativePG's: postgresql 5432, status 8000)."""
    if "cnpg.io/cluster" in labels:
        return {"postgresql": 5432, "status": 8000}
    named: dict[str, int] = {}
    for w in workloads(objs):
        if pod_labels(w) == dict(labels):
            for c in _containers(w, init=False):
                named.update({p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p})
    return named


def _peer_matches(peer: Obj, labels: Mapping[str, str], namespace: str | None) -> bool:
    """Whether a policy peer admits pods with `labels` in our namespace (None) or in namespace `namespace`."""
    if namespace is None:
        return "namespaceSelector" not in peer and _selects(peer.get("podSelector", {}), labels)
    return "namespaceSelector" in peer and \
        _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}) and \
        _selects(peer.get("podSelector", {}), labels)


# the pods we assume in outside namespaces: cluster DNS in kube-system, unlabelled pods elsewhere
OUTSIDE_PODS = {"kube-system": {"k8s-app": "kube-dns"}}


def _rule_ports(rule: Obj, named: Mapping[str, int]) -> set[int]:
    ports = set()
    for p in rule.get("ports", []):
        port = p["port"]
        ports.add(named[port] if isinstance(port, str) else port)
    return ports


def hops(objs: list[Obj], namespaces: tuple[str, ...]) -> set[Hop]:
    """Every (from, to, port) the policies allow: the callee's ingress and the caller's egress must both admit it
    (each pod is under the namespace-wide default deny). `namespaces` are the outside namespaces to consider."""
    policies = _policies(objs)
    sets = pod_sets(objs)
    allowed: set[Hop] = set()

    def admitted(labels: Mapping[str, str], direction: str, peer_labels: Mapping[str, str],
                 peer_ns: str | None, named: Mapping[str, int]) -> set[int]:
        ports: set[int] = set()
        key = "from" if direction == "Ingress" else "to"
        for p in policies:
            if direction not in p["spec"].get("policyTypes", []) or not _selects(p["spec"]["podSelector"], labels):
                continue
            for rule in p["spec"].get(direction.lower(), []):
                if not rule:  # {}: everything
                    ports.add(-1)
                elif any(_peer_matches(peer, peer_labels, peer_ns) for peer in rule.get(key, [])):
                    ports |= _rule_ports(rule, named) or {-1}
        return ports

    for src in sets.values():
        for dst in sets.values():
            named = _ports(objs, dst)
            inbound = admitted(dst, "Ingress", src, None, named)
            outbound = admitted(src, "Egress", dst, None, named)
            for port in inbound & outbound if -1 not in outbound else inbound:
                if port != -1:
                    allowed.add((_app(src), _app(dst), port))
    for ns in namespaces:
        outside = OUTSIDE_PODS.get(ns, {})
        for labels in sets.values():
            for port in admitted(labels, "Ingress", outside, ns, _ports(objs, labels)) - {-1}:
                allowed.add((f"ns:{ns}", _app(labels), port))
            for port in admitted(labels, "Egress", outside, ns, {}) - {-1}:
                allowed.add((_app(labels), f"ns:{ns}", port))
    return allowed
