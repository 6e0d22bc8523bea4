"""Builds the image and answers a turn in it as its user: the check of deploy/image that needs root, podman,
debootstrap and PyPI and takes 2-7 minutes (~1.8 GB of layers), so it is run by hand, not in the test suite
(tests/deploy/test_image.py checks the Containerfile and the manifests against each other without building).

    sudo .venv/bin/python deploy/image/verify.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMAGE = f"localhost/chatmesh:{PYPROJECT['project']['version']}"


def main() -> None:
    assert os.geteuid() == 0, "needs root (podman's storage, mount, chroot, namespaces)"
    for tool in ("podman", "debootstrap", "unshare", "chroot"):
        assert shutil.which(tool), f"{tool} not found (apt-get install podman debootstrap)"
    build = subprocess.run([str(ROOT / "deploy" / "image" / "build.sh")], capture_output=True, text=True,
                           timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(build.stderr.strip().splitlines()[-1])  # build.sh: IMAGE built in N s, M MB
    inspect = json.loads(subprocess.run(["podman", "image", "inspect", IMAGE], capture_output=True, text=True,
                                        check=True).stdout)[0]
    assert inspect["Config"]["User"] == "10001:10001"
    assert inspect["Config"].get("Entrypoint") in (None, [])
    root = Path(subprocess.run(["podman", "image", "mount", IMAGE], capture_output=True, text=True,
                               check=True).stdout.strip())
    try:
        site = root / "opt/chatmesh/venv/lib/python3.11/site-packages"
        held = {p.name.split("-")[0].lower() for p in site.iterdir()}
        assert held.isdisjoint({"pytest", "mypy", "hypothesis", "playwright", "grpc_tools", "setuptools",
                                "schemathesis", "pytriton", "nvidia_pytriton"}), held & {"pytest", "mypy"}
        assert not [c for c in ("gcc", "g++", "cc", "c++", "make") if (root / "usr/bin" / c).exists()]
        assert (root / "opt/chatmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 50_000_000
        assert sorted(p.name.split("-")[0] for p in (root / "opt/chatmesh/wheels").iterdir()) == ["chatmesh",
                                                                                                    "structlog"]
    finally:
        subprocess.run(["podman", "image", "unmount", IMAGE], capture_output=True)
    smoke = subprocess.run([str(ROOT / "deploy" / "image" / "smoke.sh"), IMAGE], capture_output=True, text=True,
                           timeout=900)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    result = json.loads(smoke.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["uid"] == 10001 and result["checks"] == {k: True for k in result["checks"]}, result
    assert "Paris" in result["reply"] and result["up_exit"] == 0
    print("deploy/image/verify.py: the image builds, holds what it should and answers a turn as its user")


if __name__ == "__main__":
    main()
