"""The rendered Kubernetes manifests of deploy/k8s, read as the cluster would run them: each overlay rendered with
`kubectl kustomize`, its objects validated against the Kubernetes schemas (kubernetes-validate) and our custom
resources against their CRDs' schemas (deploy/crd-schemas), linted, and each container's command and
environment resolved the way the kubelet resolves them (secret references, the downward API, `$(VAR)`), so the
multi-host test starts exactly what a pod would.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sim", "h100-triton")
CRD_SCHEMAS = ROOT / "deploy" / "crd-schemas"
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")  # the oldest release whose schemas we hold to, and the newest shipped
WORKLOADS = ("Deployment", "StatefulSet", "Job")

Obj = dict[str, Any]


class RenderError(RuntimeError):
    pass


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(folder: Path) -> list[Obj]:
    """`kubectl kustomize FOLDER` (offline: kustomize is built into kubectl) as a list of objects."""
    exe = kubectl()
    if exe is None:
        raise RenderError("kubectl not found")
    out = subprocess.run([exe, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RenderError(out.stderr.strip())
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# ---- schema validation ------------------------------------------------------------------------------------

def _strict(schema: Any) -> Any:
    """A CRD schema as `kubectl apply`'s strict field validation reads it: an object with declared properties
    takes no others (unless it says it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if schema.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schema(obj: Obj) -> Obj | None:
    group, _, version = obj["apiVersion"].rpartition("/")
    path = CRD_SCHEMAS / f"{group}_{obj['kind']}_{version}.json".lower()
    if not path.is_file():
        return None
    schema: Obj = _strict(json.loads(path.read_text()))
    # metadata is the API server's ObjectMeta, checked below like a built-in kind's
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return schema


BUILTIN_GROUPS = ("", "apps", "batch", "policy", "networking.k8s.io", "rbac.authorization.k8s.io")


def schema_errors(obj: Obj) -> list[str]:
    """What the Kubernetes schemas (built-in kinds) or the CRD's schema (our custom resources) say is wrong."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    group = obj.get("apiVersion", "").rpartition("/")[0]
    if group in BUILTIN_GROUPS:
        errors = []
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                errors.append(f"{where} (Kubernetes {version}): {path}: {err.message}")
        return errors
    schema = crd_schema(obj)
    if schema is None:
        return [f"{where}: no schema for {obj.get('apiVersion')} {obj.get('kind')} (add its CRD to deploy/crd-schemas)"]
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{where}: {'.'.join(str(p) for p in e.path)}: {e.message}" for e in validator.iter_errors(obj)]
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}  # ObjectMeta's schema
    try:
        kubernetes_validate.validate(meta, KUBERNETES_VERSIONS[-1], strict=True)
    except kubernetes_validate.ValidationError as err:
        errors.append(f"{where}: metadata: {err.message}")
    return errors


# ---- workloads and their containers ---------------------------------------------------------------------

def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def pod_sets(objs: list[Obj]) -> dict[str, dict[str, str]]:
    """name -> labels of every set of pods the manifests make: workloads' templates and CloudNativePG's
    instances (the operator labels them cnpg.io/cluster=<name>)."""
    sets = {f"{w['kind']}/{w['metadata']['name']}": pod_labels(w) for w in workloads(objs)}
    for o in objs:
        if o["kind"] == "Cluster" and o["apiVersion"].startswith("postgresql.cnpg.io/"):
            sets[f"Cluster/{o['metadata']['name']}"] = {"cnpg.io/cluster": o["metadata"]["name"]}
    return sets


def serve_target(container: Obj) -> str | None:
    """The service a `chatmesh serve SERVICE` container runs (None for anything else)."""
    cmd = [*container.get("command", []), *container.get("args", [])]
    return cmd[2] if cmd[:2] == ["chatmesh", "serve"] and len(cmd) == 3 else None


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


# ---- the environment a container gets ----------------------------------------------------------------------

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable is replaced, an undefined reference stays as it is."""
    return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass(frozen=True)
class Pod:
    """What the downward API and the Secrets give one pod."""

    name: str
    ip: str
    secrets: Mapping[tuple[str, str], str]  # (secret name, key) -> value


def container_env(container: Obj, pod: Pod) -> dict[str, str]:
    """The container's environment, resolved in order as the kubelet does."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = pod.secrets[(ref["name"], ref["key"])]
        elif "fieldRef" in var.get("valueFrom", {}):
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.name": pod.name, "status.podIP": pod.ip}[field]
        else:
            raise ValueError(f"{container['name']}: unsupported env source {var}")
    return env


def command(container: Obj, env: Mapping[str, str]) -> list[str]:
    return [expand(part, env) for part in [*container.get("command", []), *container.get("args", [])]]


def secret_mounts(workload: Obj, container: Obj) -> dict[str, str]:
    """mount path -> Secret name, for the container's Secret volumes."""
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod_spec(workload).get("volumes", []) if "secret" in v}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in volumes}


def mutate(objs: list[Obj], change: Callable[[list[Obj]], None]) -> list[Obj]:
    """A changed deep copy (for the tests that show a broken manifest is caught)."""
    broken = copy.deepcopy(objs)
    change(broken)
    return broken
