"""Generate kubetrain's CustomResourceDefinitions (TrainingJob, TrainingSweep, TrainingRuntime,
ClusterTrainingRuntime) from the pydantic models.

Pydantic emits JSON Schema (draft 2020-12, with $ref and anyOf for optionals);
the API server wants a *structural* OpenAPI v3.0 schema: every node typed, no
$ref, no anyOf-of-null, `exclusiveMinimum` as a boolean, free-form objects
marked `x-kubernetes-preserve-unknown-fields`. This module does that
translation, attaches the cross-field CEL rules (:data:`api.SPEC_RULES` and the sweep's),
and adds printer columns, short names and the status subresource. `spec.podTemplate` gets core/v1's own
PodTemplateSpec schema (podspec_schema.json, written by hack/podspec-schema.py from Kubernetes' OpenAPI
document), so that the API server types a podTemplate as it types a pod.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from typing import Any

import yaml

from kubetrain.core import api
from kubetrain.core.runtimes import QUEUE_REASON, lockable_paths

_DROP = {"title", "additionalProperties"}


_JOB_IMMUTABLE = "cannot change once the job exists: delete and recreate the job (its checkpoints stay on the claim)"
_SWEEP_IMMUTABLE = "cannot change once the sweep exists: delete and recreate the sweep"


def _immutable(field: str, why: str = _JOB_IMMUTABLE, mutable: tuple[str, ...] = api.MUTABLE_SPEC_FIELDS) -> dict[str, str]:
    """A transition rule on one spec field: the API server refuses an update that changes it."""
    return {"rule": "self == oldSelf", "message": f"spec.{field} {why}; editable: " + ", ".join(mutable)}


def _freeze(spec: dict[str, Any], why: str, mutable: tuple[str, ...]) -> None:
    """Transition rules on every spec field but the mutable ones."""
    for name, prop in spec["properties"].items():
        if name in mutable:
            continue
        prop.setdefault("x-kubernetes-validations", []).append(_immutable(name, why, mutable))
        if "default" not in prop:  # an optional field: setting or removing it is a change too
            spec.setdefault("x-kubernetes-validations", []).append(
                {**_immutable(name, why, mutable), "rule": f"has(self.{name}) == has(oldSelf.{name})",
                 "fieldPath": "." + name})


@cache
def pod_template_source() -> dict[str, Any]:
    """podspec_schema.json: the structural PodTemplateSpec schema and the Kubernetes version it came from."""
    data: dict[str, Any] = json.loads(resources.files("kubetrain.core").joinpath("podspec_schema.json").read_text())
    return data


def pod_template_schema() -> dict[str, Any]:
    """core/v1 PodTemplateSpec as a structural schema (a fresh copy): what the CRD's podTemplate holds."""
    return copy.deepcopy(pod_template_source()["schema"])


def _type_pod_template(spec: dict[str, Any]) -> None:
    """Give a spec schema's podTemplate (untyped in the model) the PodTemplateSpec schema, keeping its description."""
    node = spec["properties"]["podTemplate"]
    typed = pod_template_schema()
    typed["description"] = node.get("description", "") + \
        f" Typed as core/v1 PodTemplateSpec of Kubernetes {pod_template_source()['kubernetesVersion']}."
    spec["properties"]["podTemplate"] = typed


def _cel(rules: list[api.Rule]) -> list[dict[str, str]]:
    return [{"rule": r.cel, "message": r.message, "fieldPath": "." + r.path} for r in rules if r.cel is not None]


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


def _untyped(node: dict[str, Any]) -> dict[str, Any] | None:
    """A node that may hold any JSON value (a number, string or boolean parameter value), else None."""
    if node.get("x-kubernetes-preserve-unknown-fields") and "type" not in node:
        return {k: v for k, v in node.items() if k in ("x-kubernetes-preserve-unknown-fields", "description")}
    return None


def _object(node: dict[str, Any]) -> dict[str, Any]:
    """An object node's type and members: its properties, a typed map, or anything."""
    props = node.get("properties")
    addl = node.get("additionalProperties")
    if props:
        out: dict[str, Any] = {"type": "object", "properties": {name: _structural(sub) for name, sub in props.items()}}
        if node.get("required"):
            out["required"] = list(node["required"])
        return out
    if isinstance(addl, dict) and addl:
        return {"type": "object", "additionalProperties": _structural(addl)}
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one resolved JSON Schema node (recursively) into structural OpenAPI v3.0."""
    untyped = _untyped(node)
    if untyped is not None:
        return untyped
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
        out.update(_object(node))
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


def _resolved(model: type[api._Model], status: bool = True) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _structural(_resolve({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {})))
    schema["properties"]["apiVersion"] = {"type": "string", "description": f"APIVersion of this object: {api.API_VERSION}."}
    schema["properties"]["kind"] = {"type": "string", "description": f"Kind of this object: {model.__name__}."}
    schema["properties"]["metadata"] = {"type": "object"}
    # spec itself has no default: the API server checks a default against the CEL rules without
    # applying the nested defaults first, and every manifest has a spec anyway.
    schema["required"] = ["spec"]
    if status:
        _strip_defaults(schema["properties"]["status"])
    return schema


def _name_rules(max_length: int, why: str) -> list[dict[str, str]]:
    return [
        {"rule": f"self.metadata.name.size() <= {max_length}",
         "message": f"metadata.name must be at most {max_length} characters ({why})"},
        {"rule": f"self.metadata.name.matches('{api.JOB_NAME_PATTERN}')",
         "message": "metadata.name must be a lowercase DNS label (a-z, 0-9, '-') that starts with a letter"
         " (it is also the name of the job's Service, a DNS-1035 label)"},
    ]


QUEUE_HOLDS = {
    "rule": "!has(oldSelf.queue) || (has(self.queue) && self.queue == oldSelf.queue)",
    "message": "spec.scheduling.queue cannot change or be removed once set: the job's Kueue Workload holds its "
               "quota in that queue; delete and recreate the job to move it",
}
"""A transition rule: a queued job keeps its queue (its Workload's quota would leak otherwise)."""


def openapi_schema() -> dict[str, Any]:
    """The structural schema of the whole TrainingJob object."""
    schema = _resolved(api.TrainingJob)
    spec = schema["properties"]["spec"]
    _object_defaults(spec, api.TrainingJobSpec)
    _type_pod_template(spec)
    spec["x-kubernetes-validations"] = _cel(api.SPEC_RULES)
    _freeze(spec, _JOB_IMMUTABLE, api.MUTABLE_SPEC_FIELDS)
    spec["properties"]["scheduling"].setdefault("x-kubernetes-validations", []).append(QUEUE_HOLDS)
    schema["x-kubernetes-validations"] = _name_rules(50, "worker hostnames append -worker-<i>")
    return schema


def sweep_openapi_schema() -> dict[str, Any]:
    """The structural schema of the whole TrainingSweep object."""
    schema = _resolved(api.TrainingSweep)
    spec = schema["properties"]["spec"]
    _object_defaults(spec, api.TrainingSweepSpec)
    template = spec["properties"]["template"]
    template["required"] = ["spec"]  # no default, as for a job's spec: the API server checks it against the rules
    template_spec = template["properties"]["spec"]
    template_spec.pop("default", None)
    _object_defaults(template_spec, api.TrainingJobSpec)
    _type_pod_template(template_spec)
    template_spec["x-kubernetes-validations"] = _cel(api.SPEC_RULES)
    spec["properties"]["parameters"]["items"]["x-kubernetes-validations"] = _cel(api.PARAMETER_RULES)
    spec["x-kubernetes-validations"] = _cel(api.SWEEP_RULES)
    _freeze(spec, _SWEEP_IMMUTABLE, api.SWEEP_MUTABLE_SPEC_FIELDS)
    schema["x-kubernetes-validations"] = _name_rules(api.MAX_SWEEP_NAME, "trial jobs are named <sweep>-<index>")
    return schema


def runtime_openapi_schema(model: type[api._Model]) -> dict[str, Any]:
    """The structural schema of a TrainingRuntime or ClusterTrainingRuntime: no defaults at all, so that what is
    stored is what the admin wrote (a default would override every job's own value), and `locked` names fields."""
    schema = _resolved(model, status=False)
    spec = schema["properties"]["spec"]
    _strip_defaults(spec)
    _type_pod_template(spec)
    spec["properties"]["locked"]["items"]["enum"] = lockable_paths()
    spec["properties"]["locked"]["x-kubernetes-list-type"] = "set"
    spec["x-kubernetes-validations"] = [{"rule": "!has(self.scheduling) || !has(self.scheduling.queue)",
                                         "message": f"spec.scheduling.queue: {QUEUE_REASON}",
                                         "fieldPath": ".scheduling.queue"}]
    return schema


def _strip_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _strip_defaults(sub)
    if isinstance(node.get("items"), dict):
        _strip_defaults(node["items"])


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workersSummary", "description": "Workers ready/total"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.currentStep", "description": "Last step rank 0 reported"},
    {"name": "Done", "type": "string", "jsonPath": ".status.percentComplete", "description": "Steps done, % of maxSteps"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.eta", "description": "Time left at the mean step time"},
    {"name": "Loss", "type": "string", "jsonPath": ".status.loss", "description": "Last loss rank 0 reported"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount", "description": "Gang restarts"},
    {"name": "Tokens/s", "type": "integer", "jsonPath": ".status.tokensPerSecond", "priority": 1,
     "description": "Throughput of the gang"},
    {"name": "MFU", "type": "string", "jsonPath": ".status.mfu", "priority": 1,
     "description": "Model FLOPs utilization, where the device's peak is known"},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy", "priority": 1},
    {"name": "Transport", "type": "string", "jsonPath": ".status.networkTransport", "priority": 1,
     "description": "Network transport NCCL chose (IB, OFI, GPUDirectTCPX, FasTrak, Socket, P2P/SHM) or gloo"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


SWEEP_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Sweep phase"},
    {"name": "Trials", "type": "string", "jsonPath": ".status.trialsSummary", "description": "Trials done/maxTrials"},
    {"name": "Running", "type": "integer", "jsonPath": ".status.trialsRunning", "description": "Trials running"},
    {"name": "Pruned", "type": "integer", "jsonPath": ".status.trialsPruned", "description": "Trials stopped early"},
    {"name": "Best", "type": "number", "jsonPath": ".status.bestValue", "description": "Best objective value"},
    {"name": "Best-Trial", "type": "integer", "jsonPath": ".status.bestTrial", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


RUNTIME_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Image", "type": "string", "jsonPath": ".spec.image", "description": "The workers' image"},
    {"name": "Fabric", "type": "string", "jsonPath": ".spec.fabric", "description": "Network fabric profile"},
    {"name": "Locked", "type": "string", "jsonPath": ".spec.locked", "description": "Fields jobs may not override"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _definition(kind: str, plural: str, singular: str, short: list[str], schema: dict[str, Any],
                columns: list[dict[str, Any]], scope: str = "Namespaced", status: bool = True) -> dict[str, Any]:
    version = {"name": api.VERSION, "served": True, "storage": True, "schema": {"openAPIV3Schema": schema},
               "subresources": {"status": {}}, "additionalPrinterColumns": columns}
    if not status:
        del version["subresources"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/part-of": "kubetrain"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short),
                "categories": ["all", "kubetrain"],
            },
            "versions": [version],
        },
    }


def crd() -> dict[str, Any]:
    """The TrainingJob CustomResourceDefinition."""
    return _definition(api.KIND, api.PLURAL, api.SINGULAR, api.SHORT_NAMES, openapi_schema(), PRINTER_COLUMNS)


def sweep_crd() -> dict[str, Any]:
    """The TrainingSweep CustomResourceDefinition."""
    return _definition(api.SWEEP_KIND, api.SWEEP_PLURAL, api.SWEEP_SINGULAR, api.SWEEP_SHORT_NAMES,
                       sweep_openapi_schema(), SWEEP_PRINTER_COLUMNS)


def runtime_crd() -> dict[str, Any]:
    """The TrainingRuntime CustomResourceDefinition (namespaced)."""
    return _definition(api.RUNTIME_KIND, api.RUNTIME_PLURAL, api.RUNTIME_SINGULAR, ["trt"],
                       runtime_openapi_schema(api.TrainingRuntime), RUNTIME_PRINTER_COLUMNS, status=False)


def cluster_runtime_crd() -> dict[str, Any]:
    """The ClusterTrainingRuntime CustomResourceDefinition (cluster-scoped)."""
    return _definition(api.CLUSTER_RUNTIME_KIND, api.CLUSTER_RUNTIME_PLURAL, api.CLUSTER_RUNTIME_SINGULAR, ["ctrt"],
                       runtime_openapi_schema(api.ClusterTrainingRuntime), RUNTIME_PRINTER_COLUMNS, "Cluster", False)


CRDS = {api.KIND: crd, api.SWEEP_KIND: sweep_crd, api.RUNTIME_KIND: runtime_crd,
        api.CLUSTER_RUNTIME_KIND: cluster_runtime_crd}
"""Each kind's CRD, by kind; `make crds` writes one file per kind."""


HEADER = "# Generated by `kubetrain crd` from kubetrain.core.api. Do not edit: run `make crds`.\n"


def crd_yaml(kind: str = api.KIND) -> str:
    return HEADER + yaml.safe_dump(CRDS[kind](), sort_keys=False, width=120)
