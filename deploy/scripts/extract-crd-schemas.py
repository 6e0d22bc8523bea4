"""Writes the OpenAPI schemas of CustomResourceDefinitions as compact JSON (descriptions dropped), one file per
group, kind and version, for tests/deploy to validate our custom resources offline (kubernetes-validate ships
the built-in kinds' schemas only).

    python deploy/scripts/extract-crd-schemas.py OUT_DIR CRD.yaml ...

deploy/crd-schemas/ holds what it wrote from the CRDs of CloudNativePG and cert-manager (see its README).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(out: str, *crds: str) -> None:
    for path in crds:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                name = f"{spec['group']}_{spec['names']['kind']}_{version['name']}.json".lower()
                schema = strip(version["schema"]["openAPIV3Schema"])
                Path(out, name).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")
                print(name)


if __name__ == "__main__":
    main(*sys.argv[1:])
