"""Generates the Python code for `protos/` into `protos/gen/python`, or checks that it is current.

    python -m chatmesh.mesh.codegen           # regenerate
    python -m chatmesh.mesh.codegen --check   # exit 1 if the committed code differs from a fresh generation

Messages get `_pb2.py` plus `.pyi` stubs (grpcio-tools' --pyi_out); services get `_pb2_grpc.py` plus typed
`.pyi` stubs from mypy-protobuf, so `mypy --strict` checks every call through a stub.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = ROOT / "protos"
OUT = PROTO_ROOT / "gen" / "python"
PACKAGE = Path("chatmesh") / "v1"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    target = out / PACKAGE
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    bin_dir = Path(sys.executable).parent
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    done = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"protoc failed:\n{done.stderr}")
    (target / "__init__.py").write_text('"""Generated from protos/chatmesh/v1 by `./dev gen`. Do not edit."""\n')
    (target / "py.typed").write_text("")


def differences(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"only in committed: {n}" for n in cmp.left_only]
    out += [f"missing from committed: {n}" for n in cmp.right_only]
    out += [f"stale: {n}" for n in cmp.diff_files]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(OUT)
        print(f"generated {OUT / PACKAGE}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        diff = differences(OUT / PACKAGE, Path(tmp) / PACKAGE)
    if diff:
        print("generated code is stale; run ./dev gen\n  " + "\n  ".join(diff), file=sys.stderr)
        return 1
    print("generated code is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
