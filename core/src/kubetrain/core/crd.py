"""Generate the TrainingJob CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema (draft 2020-12, with $ref and anyOf for optionals);
the API server wants a *structural* OpenAPI v3.0 schema: every node typed, no
$ref, no anyOf-of-null, `exclusiveMinimum` as a boolean, free-form objects
marked `x-kubernetes-preserve-unknown-fields`. This module does that
translation, attaches the cross-field CEL rules from :data:`api.SPEC_RULES`,
and adds printer columns, short names and the status subresource.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from kubetrain.core import api

_DROP = {"title", "additionalProperties"}


def _immutable(field: str) -> dict[str, str]:
    """A transition rule on one spec field: the API server refuses an update that changes it."""
    return {"rule": "self == oldSelf",
            "message": f"spec.{field} cannot change once the job exists: delete and recreate the job "
                       "(its checkpoints stay on the claim); editable: " + ", ".join(api.MUTABLE_SPEC_FIELDS)}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)  # a field's own description/default win over the class's
        return _resolve(target, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {node}")
        merged = copy.deepcopy(variants[0])
        merged.update({k: v for k, v in node.items() if k != "anyOf"})
        if merged.get("default", 0) is None:
            del merged["default"]
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one resolved JSON Schema node (recursively) into structural OpenAPI v3.0."""
    out: dict[str, Any] = {}
    if "const" in node:
        out["type"] = "string"
        out["enum"] = [node["const"]]
    for key in ("type", "description", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
                "minItems", "maxItems", "default"):
        if key in node and key not in out:
            out[key] = node[key]
    for key, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if key in node:
            out[flag] = node[key]
            out[key] = True
    if out.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties")
        addl = node.get("additionalProperties")
        if props:
            out["properties"] = {name: _structural(sub) for name, sub in props.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(addl, dict) and addl:
            out["additionalProperties"] = _structural(addl)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "array":
        out["items"] = _structural(node.get("items", {"type": "object"}))
    if "type" not in out:
        raise ValueError(f"untyped schema node: {node}")
    return {k: v for k, v in out.items() if k not in _DROP or k == "additionalProperties"}


def _object_defaults(schema: dict[str, Any], model: type[api._Model]) -> None:
    """Nested option objects with a default_factory default to {} so the API server fills their fields."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        sub = schema["properties"].get(alias)
        if sub is None:
            continue
        ann = field.annotation
        if field.default_factory is not None and isinstance(ann, type) and issubclass(ann, api._Model):
            sub["default"] = {}
            _object_defaults(sub, ann)


def openapi_schema() -> dict[str, Any]:
    """The structural schema of the whole TrainingJob object."""
    raw = api.TrainingJob.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {}))
    schema = _structural(resolved)
    schema["properties"]["apiVersion"] = {"type": "string", "description": "APIVersion of this object: kubetrain.io/v1alpha1."}
    schema["properties"]["kind"] = {"type": "string", "description": "Kind of this object: TrainingJob."}
    schema["properties"]["metadata"] = {"type": "object"}
    # spec itself has no default: the API server checks a default against the CEL rules without
    # applying the nested defaults first, and every manifest has a spec anyway.
    schema["required"] = ["spec"]
    spec = schema["properties"]["spec"]
    _object_defaults(spec, api.TrainingJobSpec)
    spec["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": r.message, "fieldPath": "." + r.path} for r in api.SPEC_RULES
    ]
    for name, prop in spec["properties"].items():
        if name not in api.MUTABLE_SPEC_FIELDS:
            prop.setdefault("x-kubernetes-validations", []).append(_immutable(name))
            if "default" not in prop:  # an optional field: setting or removing it is a change too
                spec["x-kubernetes-validations"].append(
                    {**_immutable(name), "rule": f"has(self.{name}) == has(oldSelf.{name})", "fieldPath": "." + name})
    status = schema["properties"]["status"]
    _strip_defaults(status)
    schema["x-kubernetes-validations"] = [
        {
            "rule": "self.metadata.name.size() <= 50",
            "message": "metadata.name must be at most 50 characters (worker hostnames append -worker-<i>)",
        },
        {
            "rule": f"self.metadata.name.matches('{api.JOB_NAME_PATTERN}')",
            "message": "metadata.name must be a lowercase DNS label (a-z, 0-9, '-') that starts with a letter"
            " (it is also the name of the job's Service, a DNS-1035 label)",
        },
    ]
    return schema


def _strip_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _strip_defaults(sub)
    if isinstance(node.get("items"), dict):
        _strip_defaults(node["items"])


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workersSummary", "description": "Workers ready/total"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.currentStep", "description": "Last step rank 0 reported"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount", "description": "Gang restarts"},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/part-of": "kubetrain"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "kubetrain"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `kubetrain crd` from kubetrain.core.api. Do not edit: run `make crds`.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120)
