"""deploy/k8s, offline: every overlay renders, every object passes the Kubernetes schemas (built-in kinds) or its
CRD's schema (CloudNativePG, cert-manager), the lint rules hold, the NetworkPolicies allow exactly the design's
hops, the Prometheus scrape config loads, and a deliberately broken copy is caught by each check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import need
from tests.deploy import lint
from tests.deploy.manifests import (K8S, OVERLAYS, Obj, find, kubectl, mutate, pod_spec, render, schema_errors,
                                    serve_target, workloads)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    need(kubectl() is not None, "kubectl (its built-in kustomize renders deploy/k8s)")
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def with_citus(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """The sim overlay plus the Citus component, rendered from a copy (kustomize loads only files under its
    root, so the trying overlay lives beside the real ones)."""
    need(kubectl() is not None, "kubectl")
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    (copy / "overlays" / "sim-citus").mkdir()
    (copy / "overlays" / "sim-citus" / "kustomization.yaml").write_text(
        "resources: [../sim]\ncomponents: [../../components/citus]\n")
    return render(copy / "overlays" / "sim-citus")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_its_schema(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    assert {o["kind"] for o in objs} >= {"Deployment", "StatefulSet", "Job", "Service", "NetworkPolicy",
                                         "PodDisruptionBudget", "Cluster", "Certificate", "Issuer", "ConfigMap"}
    assert [e for o in objs for e in schema_errors(o)] == []


def test_the_citus_component_passes_its_schemas(with_citus: list[Obj]) -> None:
    cluster = find(with_citus, "Cluster", "chatmesh-pg")
    assert cluster["spec"]["postgresql"]["shared_preload_libraries"] == ["citus"]
    assert find(with_citus, "Job", "citus-distribute")
    assert [e for o in with_citus for e in schema_errors(o)] == []
    assert lint.all_problems(with_citus) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_lint_rules_hold(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert lint.all_problems(rendered[overlay]) == []


def test_the_workloads_are_the_design(rendered: dict[str, list[Obj]]) -> None:
    for overlay, objs in rendered.items():
        served = {(w["kind"], serve_target(c)) for w in workloads(objs) for c in pod_spec(w)["containers"]}
        assert served >= {("Deployment", s) for s in ("gateway", "chat", "store", "router", "moderation")}
        assert ("StatefulSet", "engine") in served
        engine = find(objs, "Service", "engine")["spec"]
        assert engine["clusterIP"] == "None" and engine["publishNotReadyAddresses"] is True
    gpu = find(rendered["h100-triton"], "StatefulSet", "engine")
    assert gpu["spec"]["replicas"] == 20
    triton = next(c for c in pod_spec(gpu)["containers"] if c["name"] == "triton")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == "8"
    volumes = {v["name"]: v for v in pod_spec(gpu)["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["readOnly"] is True
    render_step = pod_spec(gpu)["initContainers"][0]["command"][-1]
    assert render_step.startswith("chatmesh triton render --out /triton/repository")


DESIGN_HOPS = {
    ("gateway", "chat", 50051), ("gateway", "redis", 6379), ("gateway", "postgres", 5432),
    ("chat", "store", 50052), ("chat", "router", 50053), ("chat", "engine", 50054), ("chat", "moderation", 50055),
    ("chat", "chat", 50051), ("router", "engine", 50054),
    ("store", "postgres", 5432), ("store-migrate", "postgres", 5432),
    ("postgres", "postgres", 5432), ("postgres", "postgres", 8000),  # replication, the instance manager
    ("ns:ingress-nginx", "gateway", 8080),
    ("ns:cnpg-system", "postgres", 5432), ("ns:cnpg-system", "postgres", 8000),
    *(("ns:monitoring", app, port) for app, port in (("chat", 9151), ("store", 9152), ("router", 9153),
                                                     ("engine", 9154), ("moderation", 9155), ("gateway", 9180))),
    *((app, "ns:kube-system", 53) for app in ("gateway", "chat", "store", "router", "engine", "moderation",
                                              "redis", "store-migrate", "postgres")),
}
NAMESPACES = ("ingress-nginx", "monitoring", "cnpg-system", "kube-system", "default")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_designs_hops(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert lint.hops(rendered[overlay], NAMESPACES) == DESIGN_HOPS


def test_the_prometheus_scrape_config_loads(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    """promtool checks the job; Debian's Prometheus is built without Kubernetes discovery, so the copy it checks
    has static targets in place of kubernetes_sd_configs (the relabelling, the part that could be wrong, stays)."""
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool (Debian's prometheus)")
    assert promtool is not None
    config = yaml.safe_load(find(rendered["sim"], "ConfigMap", "chatmesh-prometheus")["data"]["prometheus.yml"])
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["chatmesh"]}}]
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
            "action": "keep"} in job["relabel_configs"]
    checked = {"scrape_configs": [{**{k: v for k, v in job.items() if k != "kubernetes_sd_configs"},
                                   "static_configs": [{"targets": ["127.0.0.1:9151"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(checked))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    for w in workloads(rendered["sim"]):
        for c in pod_spec(w)["containers"]:
            if serve_target(c):  # every chatmesh service names its metrics port so the job finds it
                assert "metrics" in {p["name"] for p in c["ports"]}, w["metadata"]["name"]


# ---- broken copies are caught ------------------------------------------------------------------------------

def _broken_source(tmp: Path, path: str, old: str, new: str) -> list[Obj]:
    """The sim overlay rendered from a copy of deploy/k8s with one source file changed."""
    copy = tmp / "k8s"
    shutil.copytree(K8S, copy)
    target = copy / path
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new, 1))
    return render(copy / "overlays" / "sim")


def test_a_wrong_field_in_a_source_file_is_caught(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    objs = _broken_source(tmp_path, "base/store.yaml", "terminationGracePeriodSeconds: 15",
                          "terminationGracePeriod: 15")
    errors = [e for o in objs for e in schema_errors(o)]
    assert errors and all("Deployment/store" in e for e in errors) and "terminationGracePeriod" in errors[0]


def test_a_missing_probe_in_a_source_file_is_caught(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    objs = _broken_source(tmp_path, "base/router.yaml",
                          "          readinessProbe:\n            grpc: {port: 8086}\n            periodSeconds: 5\n", "")
    assert lint.all_problems(objs) == ["Deployment/router router: no readinessProbe"]


def _containers_of(objs: list[Obj], name: str) -> list[Obj]:
    w = next(w for w in workloads(objs) if w["metadata"]["name"] == name)
    containers: list[Obj] = pod_spec(w)["containers"]
    return containers


def _env(objs: list[Obj], workload: str, name: str, value: str) -> None:
    for var in _containers_of(objs, workload)[0]["env"]:
        if var["name"] == name:
            var.clear()
            var.update(name=name, value=value)


CASES = {
    "a CRD field misspelled": (lambda o: find(o, "Cluster", "chatmesh-pg")["spec"].update(instance=3),
                               "Cluster/chatmesh-pg", "schema"),
    "a certificate without its issuer": (lambda o: find(o, "Certificate", "chatmesh-chat")["spec"].pop("issuerRef"),
                                         "Certificate/chatmesh-chat", "schema"),
    "a latest tag": (lambda o: _containers_of(o, "gateway")[0].update(image="registry.example.internal/chatmesh:latest"),
                     "Deployment/gateway gateway: image", "lint"),
    "a misspelled setting": (lambda o: _containers_of(o, "chat")[0]["env"].append(
        {"name": "CHATMESH_STORE_ADRESS", "value": "store:50052"}), "CHATMESH_STORE_ADRESS is no chatmesh setting",
        "lint"),
    "a literal secret": (lambda o: _env(o, "engine", "CHATMESH_CACHE_SALT_SECRET", "hunter2"),
                         "CHATMESH_CACHE_SALT_SECRET is a literal", "lint"),
    "no resources": (lambda o: _containers_of(o, "moderation")[0].pop("resources"),
                     "Deployment/moderation moderation: no requests.cpu", "lint"),
    "a drain cut short": (lambda o: pod_spec(find(o, "Deployment", "chat")).update(terminationGracePeriodSeconds=10),
                          "Deployment/chat: terminationGracePeriodSeconds 10", "lint"),
    "one gateway": (lambda o: find(o, "Deployment", "gateway")["spec"].update(replicas=1),
                    "Deployment/gateway: 1 replicas", "lint"),
    "a pod no policy covers": (lambda o: find(o, "NetworkPolicy", "moderation")["spec"].update(
        podSelector={"matchLabels": {"app.kubernetes.io/name": "moderatoin"}}),
        "Deployment/moderation: no NetworkPolicy of its own for egress", "lint"),
    "the signing keys in chat": (lambda o: pod_spec(find(o, "Deployment", "chat"))["volumes"].append(
        {"name": "stolen", "secret": {"secretName": "chatmesh-owner-token-keys", "defaultMode": 0o440}}),
        "Deployment/chat: reaches chatmesh-owner-token-keys", "lint"),
    "the CA's key in the store": (lambda o: _containers_of(o, "store")[0]["env"].append(
        {"name": "CA_KEY", "valueFrom": {"secretKeyRef": {"name": "chatmesh-mesh-ca", "key": "tls.key"}}}),
        "Deployment/store: reaches chatmesh-mesh-ca", "lint"),
    "another service's key": (lambda o: pod_spec(find(o, "Deployment", "router"))["volumes"].append(
        {"name": "other", "secret": {"secretName": "chatmesh-tls-store", "defaultMode": 0o440}}),
        "Deployment/router: reaches chatmesh-tls-store", "lint"),
    "a key every user may read": (lambda o: next(v for v in pod_spec(find(o, "Deployment", "gateway"))["volumes"]
                                                 if v["name"] == "owner-tokens")["secret"].pop("defaultMode"),
                                  "lets every user read its private key (defaultMode 644)", "lint"),
    "a probe on the mTLS port": (lambda o: _containers_of(o, "store")[0]["readinessProbe"].update(
        grpc={"port": 50052}), "Deployment/store store: readinessProbe is not a gRPC probe", "lint"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_object_is_caught(rendered: dict[str, list[Obj]], case: str) -> None:
    change, expected, check = CASES[case]
    broken = mutate(rendered["sim"], change)
    found = [e for o in broken for e in schema_errors(o)] if check == "schema" else lint.all_problems(broken)
    assert any(expected in line for line in found), found


def test_an_extra_hop_is_seen(rendered: dict[str, list[Obj]]) -> None:
    def open_store(objs: list[Obj]) -> None:
        ingress = find(objs, "NetworkPolicy", "store")["spec"]["ingress"][0]["from"]
        ingress.append({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}})
        gateway_egress = find(objs, "NetworkPolicy", "gateway")["spec"]["egress"]
        gateway_egress.append({"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "store"}}}],
                               "ports": [{"protocol": "TCP", "port": 50052}]})

    assert lint.hops(mutate(rendered["sim"], open_store), NAMESPACES) - DESIGN_HOPS == {("gateway", "store", 50052)}


def test_the_signing_keys_reach_the_gateway_alone_and_the_cas_key_no_pod(rendered: dict[str, list[Obj]]) -> None:
    """Issue 30: the keys the manifests keep apart, named (the lint rule `keys_apart` refuses the rest)."""
    for objs in rendered.values():
        reach = {w["metadata"]["name"]: {name for name, _ in lint._secret_uses(w)} for w in workloads(objs)}
        assert [w for w, names in reach.items() if lint.SIGNING_KEYS in names] == ["gateway"]
        assert [w for w, names in reach.items() if lint.CA_SECRET in names] == []
        for service in ("gateway", "chat", "store", "router", "moderation", "engine"):
            assert [w for w, names in reach.items() if f"chatmesh-tls-{service}" in names] == [service]
        assert find(objs, "Certificate", "chatmesh-mesh-ca")["spec"]["secretName"] == lint.CA_SECRET
