"""A job's spec over its runtime's: the one merge the operator, `kubetrain validate` and local runs apply. Pure.

A TrainingRuntime or ClusterTrainingRuntime (api.TrainingRuntimeSpec) holds an admin's defaults for the jobs
that name it in spec.runtimeRef. The effective spec is the runtime's fields with the job's own over them:
mappings merge key by key, `env` by variable name, `scheduling.tolerations` add up, `podTemplate` merges as a
job's podTemplate merges over the generated pod (lists of named objects by name); any other value the job sets
replaces the runtime's. What a job "sets" is what differs from the API's default (the API server fills in the
defaults of every stored job, so a default cannot be told from one written out): a job cannot reset a runtime's
value to the built-in default, and a locked field that equals the default in the job is not an override.

A locked path (spec.locked) keeps the runtime's value: where the merged spec differs from the runtime's there,
the job is refused with the path named. A job's own fabric daemon image is refused in every case
(api.DAEMON_IMAGE_RULE): it runs as root beside the workers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kubetrain.core import api, contract, pod_template

QUEUE_REASON = ("a job's Kueue LocalQueue is its own (a quota of its namespace): set scheduling.queue in the job, "
                "or require one there (chart value queues.requiredIn)")
MAX_SHOWN = 80
"""Characters of a locked value quoted in a refusal."""


@dataclass(frozen=True)
class Resolved:
    """A job's spec over its runtime's: the spec to run, or the problems (each `spec.<path>: <reason>`)."""

    spec: api.TrainingJobSpec | None
    problems: list[str]
    fabric_from_runtime: bool = False
    """The effective fabric is the runtime's (an admin's choice: its host-level needs are not the tenant's)."""


def runtime_values(runtime: api.TrainingRuntimeSpec) -> dict[str, Any]:
    """The fields the runtime's author set, in wire form, without `locked`."""
    return runtime.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json", exclude={"locked"})


def lockable_paths(model: type[api._Model] = api.TrainingRuntimeSpec, prefix: str = "") -> list[str]:
    """Every path `locked` may name: the runtime's fields and the fields of its nested option objects."""
    found = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        if alias == "locked":
            continue
        found.append(prefix + alias)
        sub = _model_of(info.annotation)
        if sub is not None:
            found += lockable_paths(sub, f"{prefix}{alias}.")
    return found


def _model_of(annotation: Any) -> type[api._Model] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, api._Model):
            return candidate
    return None


def runtime_problems(runtime: api.TrainingRuntimeSpec) -> list[str]:
    """What is wrong with a runtime on its own: a locked path it has no field for, a podTemplate of the wrong shape."""
    known = set(lockable_paths())
    found = [f"spec.locked[{i}]: {path!r} is no field of a runtime (one of: {', '.join(sorted(known))})"
             for i, path in enumerate(runtime.locked or []) if path not in known]
    if runtime.scheduling is not None and runtime.scheduling.queue is not None:
        found.append(f"spec.scheduling.queue: {QUEUE_REASON}")
    if runtime.pod_template is not None:
        shape = pod_template.shape_problems(runtime.pod_template)
        found += [f"spec.{p}: {m}" for p, m in shape or pod_template.owned_problems(runtime.pod_template)]
    return found


TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "image": ("containers", "image"), "env": ("containers", "env"), "resources": ("containers", "resources"),
    "scheduling.nodeSelector": ("spec", "nodeSelector"), "scheduling.tolerations": ("spec", "tolerations"),
    "scheduling.affinity": ("spec", "affinity"), "scheduling.priorityClassName": ("spec", "priorityClassName"),
    "scheduling.schedulerName": ("spec", "schedulerName"),
}
"""Runtime fields a job's podTemplate could set around them: the trainer container's image, env and resources,
the pod's placement. Under a lock, a job's own podTemplate may not set them either."""


def resolve(job: api.TrainingJobSpec, kind: str, name: str, runtime: api.TrainingRuntimeSpec,
            enforce: bool = True) -> Resolved:
    """The job's spec over the runtime's, or every reason why not. `enforce` False (a job already started, whose
    scheduling was edited since): a locked field keeps the runtime's value, and `problems` say what was ignored."""
    problems = runtime_problems(runtime)
    if problems:
        return Resolved(None, [f"spec.runtimeRef: {kind} {name} is not valid: {'; '.join(problems)}"])
    base, own = runtime_values(runtime), job.dump_changed()
    merged = merge(base, own)
    locked = [path for path in runtime.locked or [] if _lockable(merged, path) != _lockable(base, path)]
    problems = [f"spec.{path}: locked by {kind} {name}{_shown(_at(base, path))}" for path in locked]
    problems += [f"spec.podTemplate.{where}: sets {path}, locked by {kind} {name}"
                 for path, where in template_overrides(own.get("podTemplate"), runtime.locked or [])]
    if not enforce:
        merged = merge(merged, {"podTemplate": base.get("podTemplate")} if "podTemplate" in locked else {})
        for path in locked:
            _put(merged, path, _at(base, path))
    try:  # without runtimeRef: the rules a job with one leaves to the merge hold here
        spec = api.TrainingJobSpec.model_validate_json(json.dumps({k: v for k, v in merged.items() if k != "runtimeRef"}))
    except ValidationError as exc:
        return Resolved(None, problems + [f"spec.{_loc(e['loc'])}: {e['msg']} (with {kind} {name})"
                                          for e in exc.errors()])
    invalid = [f"spec.{path}: {message} (with {kind} {name})" for path, message in spec.rule_violations()
               if path != api.DAEMON_IMAGE_RULE.path]
    fabric_from_runtime = "fabric" in base and _at(merged, "fabric") == base["fabric"]
    spec = spec.model_copy(update={"runtime_ref": job.runtime_ref})
    ok = not invalid and (not problems or not enforce)
    return Resolved(spec if ok else None, problems + invalid, fabric_from_runtime)


def template_overrides(template: Any, locked: list[str]) -> list[tuple[str, str]]:
    """(locked path, where) for each field a job's own podTemplate sets that a lock covers (TEMPLATE_FIELDS)."""
    spec = (template or {}).get("spec") if isinstance(template, Mapping) else None
    if not isinstance(spec, Mapping):
        return []
    found = []
    for path, (part, field) in TEMPLATE_FIELDS.items():
        if not any(path == lock or path.startswith(lock + ".") or lock.startswith(path + ".") for lock in locked):
            continue
        if part == "spec" and field in spec:
            found.append((path, f"spec.{field}"))
        elif part == "containers":
            found += [(path, f"spec.containers[{c.get('name')}].{field}") for c in spec.get("containers") or []
                      if isinstance(c, Mapping) and c.get("name") == contract.CONTAINER and field in c]
    return found


def merge(base: Mapping[str, Any], own: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """`own` over `base` (wire-form mappings), by the rules of the module's docstring."""
    out = dict(base)
    for key, value in own.items():
        at = f"{path}{key}"
        have = out.get(key)
        if at == "podTemplate" and isinstance(have, Mapping):
            out[key] = pod_template.merge(have, value)
        elif isinstance(value, Mapping) and isinstance(have, Mapping):
            out[key] = merge(have, value, at + ".")
        elif isinstance(value, list) and isinstance(have, list):
            out[key] = _merge_list(at, have, value)
        else:
            out[key] = value
    return out


def _merge_list(path: str, base: list[Any], own: list[Any]) -> list[Any]:
    if path == "env":
        return pod_template.merge(base, own, "env")
    if path == "scheduling.tolerations":
        return [*base, *(t for t in own if t not in base)]
    return list(own)


def _lockable(values: Mapping[str, Any], path: str) -> Any:
    """The value at `path`, with only what a runtime can set under it: a lock on `checkpoint` covers storage, not
    how often the job saves."""
    return _project(_at(values, path), _model_at(path))


def _model_at(path: str) -> type[api._Model] | None:
    model: type[api._Model] | None = api.TrainingRuntimeSpec
    for part in path.split("."):
        info = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None) if model else None
        model = _model_of(info.annotation) if info is not None else None
    return model


def _project(value: Any, model: type[api._Model] | None) -> Any:
    if model is None or not isinstance(value, Mapping):
        return value
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    return {k: _project(v, _model_of(fields[k].annotation)) for k, v in value.items() if k in fields}


def _put(values: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = values
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value


def _at(values: Mapping[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _shown(value: Any) -> str:
    if value is None:
        return " (which leaves it unset)"
    text = json.dumps(value, separators=(",", ":"))
    return f" to {text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + '...'}"


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)
