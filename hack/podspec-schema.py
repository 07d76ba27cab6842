#!/usr/bin/env python3
"""Write core/src/kubetrain/core/podspec_schema.json: core/v1 PodTemplateSpec as a structural CRD schema.

    hack/podspec-schema.py [OPENAPI_V3_JSON]

The source is Kubernetes' own OpenAPI v3 document for the core group, `api/openapi-spec/v3/api__v1_openapi.json`
of the k8s.io/kubernetes module that hack/k8s/go.mod pins (default: that file in `go env GOMODCACHE`, or
~/go/pkg/mod). The CRD embeds the result as `spec.podTemplate` (kubetrain.core.crd), so that the API server
types a podTemplate as it types a pod: every $ref resolved, descriptions, defaults, formats and patch
markers dropped, int-or-string and quantity fields marked `x-kubernetes-int-or-string`, list-type `map`
kept only where its keys are required (else `atomic`), and nothing required at the top: a podTemplate is
partial (it merges over the pod kubetrain builds). Its metadata is typed for labels and annotations only;
other metadata keys are kept so that kubetrain's own checks can name them. Run `make crds` afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "core/src/kubetrain/core/podspec_schema.json"
PREFIX = "#/components/schemas/"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
"""resource.Quantity's syntax, as controller-gen writes it into CRDs."""
KEEP = ("x-kubernetes-list-type", "x-kubernetes-map-type", "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-int-or-string", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems")


def k8s_version() -> str:
    found = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", (REPO / "hack/k8s/go.mod").read_text(), re.M)
    if found is None:
        raise SystemExit("hack/k8s/go.mod pins no k8s.io/kubernetes")
    return found.group(1)


def default_source(version: str) -> Path:
    try:
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        cache = ""
    root = Path(cache or os.path.expanduser("~/go/pkg/mod"))
    return root / f"k8s.io/kubernetes@{version}/api/openapi-spec/v3/api__v1_openapi.json"


class Converter:
    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas

    def ref(self, name: str, stack: tuple[str, ...]) -> dict[str, Any]:
        if name == QUANTITY:
            return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
        if name == INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True}
        if name in stack:  # no recursion in a PodSpec today; a structural schema cannot express one
            raise SystemExit(f"recursive schema: {' -> '.join((*stack, name))}")
        return self.node(self.schemas[name], (*stack, name))

    def node(self, node: dict[str, Any], stack: tuple[str, ...]) -> dict[str, Any]:
        if "$ref" in node:
            return self.ref(node["$ref"].removeprefix(PREFIX), stack)
        if "allOf" in node:
            if len(node["allOf"]) != 1:
                raise SystemExit(f"allOf of several schemas at {stack}")
            return self.node(node["allOf"][0], stack) | {k: node[k] for k in KEEP if k in node}
        if node.get("format") == "int-or-string":
            return {"x-kubernetes-int-or-string": True}
        out: dict[str, Any] = {}
        kind = node.get("type")
        if kind is None:
            raise SystemExit(f"untyped schema node at {stack}: {sorted(node)}")
        out["type"] = kind
        out |= {k: node[k] for k in KEEP if k in node}
        if kind == "object":
            if node.get("properties"):
                out["properties"] = {k: self.node(v, stack) for k, v in node["properties"].items()}
                if node.get("required"):
                    out["required"] = list(node["required"])
            elif isinstance(node.get("additionalProperties"), dict):
                out["additionalProperties"] = self.node(node["additionalProperties"], stack)
            else:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif kind == "array":
            items = self.node(node["items"], stack)
            out["items"] = items
            self.list_keys(node, out, items)
        return out

    @staticmethod
    def list_keys(source: dict[str, Any], out: dict[str, Any], items: dict[str, Any]) -> None:
        """A list-type map's keys must be required in its items (or defaulted): else the list is atomic."""
        keys = source.get("x-kubernetes-list-map-keys")
        if out.get("x-kubernetes-list-type") != "map" or not keys:
            return
        if set(keys) <= set(items.get("required", ())):
            out["x-kubernetes-list-map-keys"] = list(keys)
        else:
            out["x-kubernetes-list-type"] = "atomic"


def pod_template_schema(schemas: dict[str, Any]) -> dict[str, Any]:
    spec = Converter(schemas).ref("io.k8s.api.core.v1.PodSpec", ())
    spec.pop("required", None)  # partial: merged over kubetrain's pod, which has its containers
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    metadata = {"type": "object", "properties": {"labels": strings, "annotations": strings},
                "x-kubernetes-preserve-unknown-fields": True}
    return {"type": "object", "properties": {"metadata": metadata, "spec": spec}}


def main(argv: list[str]) -> int:
    version = k8s_version()
    source = Path(argv[0]) if argv else default_source(version)
    schemas = json.loads(source.read_text())["components"]["schemas"]
    doc = {
        "source": f"k8s.io/kubernetes@{version} api/openapi-spec/v3/api__v1_openapi.json (hack/podspec-schema.py)",
        "kubernetesVersion": version,
        "schema": pod_template_schema(schemas),
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(REPO)} ({OUT.stat().st_size} bytes) from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
