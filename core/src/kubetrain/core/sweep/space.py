"""A sweep's search space: the TrainingJob spec fields it tunes, their Optuna distributions, and the
TrainingJob manifests its trials run.

A parameter's `path` names a spec field as a manifest writes it (`optimizer.lr`, `microBatchSize`).
A trial's job is the template's spec exactly as the user wrote it (no defaults filled in) with each
parameter's value set at its path, so a trial manifest reads like one a user would write by hand.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any, Literal, Union, get_args, get_origin

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import BaseModel, ValidationError

from kubetrain.core.api import (
    API_VERSION,
    KIND,
    ObjectMeta,
    SweepParameter,
    TrainingJobSpec,
    TrainingJobTemplate,
    TrainingSweepSpec,
    grid_points,
)
from kubetrain.core.api import grid_size as api_grid_size
from kubetrain.core.contract import LABEL_SWEEP, LABEL_TRIAL

SpecProblem = tuple[str, str]
"""(spec-relative path, reason)."""
FieldKind = Literal["int", "float", "bool", "str", "choice"]
"""What a tunable spec field holds; `choice` is one of a fixed set of strings (strategy, precision, ...)."""
BEST_SUFFIX = "-best"
MAX_JOB_NAME = next(m.max_length for m in ObjectMeta.model_fields["name"].metadata if hasattr(m, "max_length"))
"""The longest TrainingJob name (50): a sweep's name has room for `-<index>`, not always for `-best`."""


class TrialSpecError(ValueError):
    """Parameters that make the template an invalid TrainingJob spec; `problems` names each (spec paths)."""

    def __init__(self, problems: list[SpecProblem]):
        self.problems = problems
        super().__init__("; ".join(f"{path}: {reason}" for path, reason in problems))


def trial_job_name(sweep: str, index: int) -> str:
    """The TrainingJob of trial `index` (deterministic, so that creating it again is harmless)."""
    return f"{sweep}-{index}"


def best_job_name(sweep: str) -> str:
    """The job that reruns the best parameters: `<sweep>-best`, the sweep's name shortened so that it fits."""
    return sweep[: MAX_JOB_NAME - len(BEST_SUFFIX)] + BEST_SUFFIX


# --------------------------------------------------------------------------- spec fields by path


class _PathError(Exception):
    pass


def _plain(annotation: Any) -> Any:
    """The annotation without its `| None`."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


_SCALARS: dict[Any, FieldKind] = {bool: "bool", int: "int", float: "float", str: "str"}
_NOUNS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string", "choice": "a string"}


def _scalar_kind(annotation: Any) -> FieldKind | None:
    if get_origin(annotation) is Literal:
        return "choice"
    return _SCALARS.get(annotation)


def _noun(annotation: Any) -> str:
    """What a field holds, for a message: `a number`, `a list`, ..."""
    kind = _scalar_kind(annotation)
    if kind is not None:
        return _NOUNS[kind]
    origin = get_origin(annotation)
    if origin is list:
        return "a list"
    return "a mapping" if origin is dict or annotation is dict else "a value of another kind"


def _fields(model: type[BaseModel]) -> dict[str, Any]:
    """A model's fields by their manifest (camelCase) names, with their plain annotations."""
    return {(info.alias or name): _plain(info.annotation) for name, info in model.model_fields.items()}


def _field_kind(path: str) -> FieldKind:
    """What the TrainingJob spec field at `path` holds; _PathError says why it is not a field a parameter can set."""
    model: type[BaseModel] = TrainingJobSpec
    parts = path.split(".")
    for depth, name in enumerate(parts):
        fields = _fields(model)
        if name not in fields:
            where = ".".join(parts[:depth]) or "a TrainingJob spec"
            raise _PathError(f"{where} has no field {name!r}; its fields: {', '.join(sorted(fields))}")
        annotation, here, last = fields[name], ".".join(parts[: depth + 1]), depth == len(parts) - 1
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if last:
                raise _PathError(f"{here} is an object, not a value: name one of its fields "
                                 f"({', '.join(sorted(_fields(annotation)))})")
            model = annotation
            continue
        kind = _scalar_kind(annotation)
        if not last:
            raise _PathError(f"{here} is {_noun(annotation)}, not an object with fields")
        if kind is None:
            raise _PathError(f"{here} is {_noun(annotation)}, not a single value a parameter can set")
        return kind
    raise _PathError("empty path")  # SPEC_PATH_PATTERN makes every path at least one name


def _type_problem(param: SweepParameter, kind: FieldKind) -> str | None:
    """Why a parameter's type cannot set a field of this kind (an int parameter may set a float field)."""
    if param.type == "categorical" or kind == "float" or (param.type == "int" and kind == "int"):
        return None
    if kind == "int":
        return f"{param.path} is an integer field: use type int"
    return f"{param.path} holds {_NOUNS[kind]}: use type categorical"


# --------------------------------------------------------------------------- trial specs


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = tree
    for name in parents:
        child = node.get(name)
        node[name] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[leaf] = value


def _reason(err: Any) -> str:
    """A pydantic error worded as `kubetrain validate` words problems (`must be ...`)."""
    msg = str(err["msg"])
    return "must" + msg[len("Input should"):] if msg.startswith("Input should") else msg


def _loc(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _as_written(template: TrainingJobTemplate) -> dict[str, Any]:
    return template.spec.model_dump(by_alias=True, exclude_unset=True, mode="json")


def trial_spec(template: TrainingJobTemplate, params: Mapping[str, Any]) -> TrainingJobSpec:
    """The template's spec with each parameter set at its path; TrialSpecError when that is not a valid spec."""
    wire = json.loads(json.dumps(_as_written(template)))  # a deep copy _set may change
    for path, value in params.items():
        _set(wire, path, value)
    try:
        spec = TrainingJobSpec.model_validate_json(json.dumps(wire), strict=True)
    except ValidationError as exc:
        raise TrialSpecError([(_loc(e["loc"]), _reason(e)) for e in exc.errors()]) from None
    if spec.rule_violations():
        raise TrialSpecError(spec.rule_violations())
    return spec


# --------------------------------------------------------------------------- checking a space


def _probes(param: SweepParameter) -> Iterator[tuple[str, Any]]:
    """(spec-relative attribute, value) for each value that bounds what a parameter takes."""
    if param.type == "categorical":
        yield from ((f"values[{j}]", v) for j, v in enumerate(param.values or []))
        return
    for attr in ("low", "high"):
        value = getattr(param, attr)
        yield attr, int(value) if param.type == "int" else value


def _step_problem(param: SweepParameter) -> str | None:
    if param.step is None or param.low is None or param.high is None:
        return None
    span = Decimal(str(param.high)) - Decimal(str(param.low))
    return None if span % Decimal(str(param.step)) == 0 else "high - low must be a multiple of step"


def _parameter_problems(spec: TrainingSweepSpec, i: int, param: SweepParameter) -> list[SpecProblem]:
    at = f"parameters[{i}]"
    try:
        kind = _field_kind(param.path)
    except _PathError as exc:
        return [(f"{at}.path", str(exc))]
    wrong_type = _type_problem(param, kind)
    if wrong_type is not None:
        return [(f"{at}.type", wrong_type)]
    step = _step_problem(param)
    found = [(f"{at}.step", step)] if step else []
    for attr, value in _probes(param):
        try:
            trial_spec(spec.template, {param.path: value})
        except TrialSpecError as exc:
            path, reason = exc.problems[0]
            found.append((f"{at}.{attr}", f"{json.dumps(value)} makes an invalid TrainingJob: {path}: {reason}"))
    return found


def check_space(spec: TrainingSweepSpec) -> list[SpecProblem]:
    """(spec-relative path, reason) for every problem of the search space; empty when every trial can run.

    Each parameter must name a scalar TrainingJob spec field of its type, and each of its bounds
    (low and high) or values, set alone in the template, must give a valid TrainingJob spec.
    """
    found = spec.rule_violations()
    if any(path.startswith("template.") for path, _ in found):
        return found  # every probe would report the template's own problem again
    for i, param in enumerate(spec.parameters):
        if not any(path.startswith(f"parameters[{i}].") for path, _ in found):
            found += _parameter_problems(spec, i, param)
    return found


# --------------------------------------------------------------------------- Optuna distributions


def distribution(param: SweepParameter) -> BaseDistribution:
    """The Optuna distribution of one (valid) parameter."""
    if param.type == "categorical":
        return CategoricalDistribution(list(param.values or []))
    low, high = float(param.low or 0), float(param.high or 0)
    if param.type == "int":
        return IntDistribution(int(low), int(high), log=param.log, step=int(param.step or 1))
    return FloatDistribution(low, high, log=param.log, step=param.step)


def distributions(spec: TrainingSweepSpec) -> dict[str, BaseDistribution]:
    """Every parameter's distribution, by its path."""
    return {p.path: distribution(p) for p in spec.parameters}


def grid_values(param: SweepParameter) -> list[Any]:
    """Every value the grid sampler tries: the categorical values, or low, low + step, ..., high (step 1 for an
    int parameter without one; a float one has a step, which the grid sampler's rule requires)."""
    if param.values is not None:
        return list(param.values)
    low, step = Decimal(str(param.low)), Decimal(str(param.step or 1))
    values = [low + k * step for k in range(grid_points(param))]
    return [int(v) for v in values] if param.type == "int" else [float(v) for v in values]


def grid_size(spec: TrainingSweepSpec) -> int | None:
    """How many trials the grid has (None unless the sampler is grid), counted without listing them; above
    MAX_GRID_POINTS, some product above it (such a spec is refused before any grid is built)."""
    if spec.sampler.type != "grid":
        return None
    return api_grid_size(spec.parameters)


# --------------------------------------------------------------------------- manifests


def _manifest(name: str, namespace: str | None, spec: TrainingSweepSpec, params: Mapping[str, Any],
              extra_labels: Mapping[str, str]) -> dict[str, Any]:
    template_meta = spec.template.metadata or {}
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    labels = {**(template_meta.get("labels") or {}), **extra_labels}
    if labels:
        metadata["labels"] = labels
    if template_meta.get("annotations"):
        metadata["annotations"] = dict(template_meta["annotations"])
    job_spec = trial_spec(spec.template, params)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
            "spec": job_spec.model_dump(by_alias=True, exclude_unset=True, mode="json")}


def trial_manifest(sweep_name: str, namespace: str | None, spec: TrainingSweepSpec, index: int,
                   params: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainingJob manifest of trial `index`: the template with `params` set, labelled with the sweep and
    the trial. Backends add their own ownerReferences and output directories. TrialSpecError when the
    parameters make an invalid spec (the policy records such a trial Failed and never starts it)."""
    labels = {LABEL_SWEEP: sweep_name, LABEL_TRIAL: str(index)}
    return _manifest(trial_job_name(sweep_name, index), namespace, spec, params, labels)


def best_manifest(sweep_name: str, namespace: str | None, spec: TrainingSweepSpec,
                  params: Mapping[str, Any]) -> dict[str, Any]:
    """A ready-to-run TrainingJob with the best parameters, `<sweep>-best`, not labelled as one of the sweep's trials."""
    return _manifest(best_job_name(sweep_name), namespace, spec, params, {})
