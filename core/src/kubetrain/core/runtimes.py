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

from kubetrain.core import api, pod_template

NAMED_LISTS = frozenset({"containers", "initContainers", "ephemeralContainers", "volumes", "env", "volumeMounts",
                         "ports", "envFrom"})
"""podTemplate lists whose items merge by `name` (as builders merge a job's podTemplate over the pod)."""
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
    if runtime.pod_template is not None:
        shape = pod_template.shape_problems(runtime.pod_template)
        found += [f"spec.{p}: {m}" for p, m in shape or pod_template.owned_problems(runtime.pod_template)]
    return found


def resolve(job: api.TrainingJobSpec, kind: str, name: str, runtime: api.TrainingRuntimeSpec) -> Resolved:
    """The job's spec over the runtime's, or every reason why not."""
    problems = runtime_problems(runtime)
    if problems:
        return Resolved(None, [f"spec.runtimeRef: {kind} {name} is not valid: {'; '.join(problems)}"])
    base, own = runtime_values(runtime), job.dump_changed()
    merged = merge(base, own)
    problems = [f"spec.{path}: locked by {kind} {name}{_shown(_at(base, path))}"
                for path in runtime.locked or [] if _at(merged, path) != _at(base, path)]
    try:  # without runtimeRef: the rules a job with one leaves to the merge hold here
        spec = api.TrainingJobSpec.model_validate_json(json.dumps({k: v for k, v in merged.items() if k != "runtimeRef"}))
    except ValidationError as exc:
        return Resolved(None, problems + [f"spec.{_loc(e['loc'])}: {e['msg']} (with {kind} {name})"
                                          for e in exc.errors()])
    problems += [f"spec.{path}: {message} (with {kind} {name})" for path, message in spec.rule_violations()
                 if path != api.DAEMON_IMAGE_RULE.path]
    fabric_from_runtime = "fabric" in base and _at(merged, "fabric") == base["fabric"]
    spec = spec.model_copy(update={"runtime_ref": job.runtime_ref})
    return Resolved(None if problems else spec, problems, fabric_from_runtime)


def merge(base: Mapping[str, Any], own: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """`own` over `base` (wire-form mappings), by the rules of the module's docstring."""
    out = dict(base)
    for key, value in own.items():
        at = f"{path}{key}"
        have = out.get(key)
        if isinstance(value, Mapping) and isinstance(have, Mapping):
            out[key] = merge(have, value, at + ".")
        elif isinstance(value, list) and isinstance(have, list):
            out[key] = _merge_list(at, have, value)
        else:
            out[key] = value
    return out


def _merge_list(path: str, base: list[Any], own: list[Any]) -> list[Any]:
    key = path.rsplit(".", 1)[-1]
    if path == "env" or (path.startswith("podTemplate.") and key in NAMED_LISTS):
        return _by_name(path, base, own)
    if path == "scheduling.tolerations":
        return [*base, *(t for t in own if t not in base)]
    return list(own)


def _by_name(path: str, base: list[Any], own: list[Any]) -> list[Any]:
    """Items with a name replace (or, mappings, merge over) the base's item of that name; the rest are added."""
    out = list(base)
    index = {item.get("name"): i for i, item in enumerate(out) if isinstance(item, Mapping) and item.get("name")}
    for item in own:
        name = item.get("name") if isinstance(item, Mapping) else None
        if name in index:
            i = index[name]
            out[i] = item if path == "env" else merge(out[i], item, f"{path}.")
        else:
            out.append(item)
    return out


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
