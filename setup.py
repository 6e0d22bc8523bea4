"""Maps the top-level service folders onto one import namespace, `chatmesh.*` (the layout README.md describes):
`store/chatmesh/store` is imported as `chatmesh.store`, `engine-adapter/chatmesh/engine_adapter` as
`chatmesh.engine_adapter`, and the generated protobuf code in `protos/gen/python` as `chatmesh.v1`."""

from setuptools import find_namespace_packages, setup

ROOTS = ["protos/gen/python", "mesh", "model", "gateway", "chat", "store", "router", "engine-adapter", "moderation"]

packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["chatmesh.*"], exclude=["*.__pycache__"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
