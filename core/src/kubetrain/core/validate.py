"""Load TrainingJob and TrainingSweep manifests and explain what is wrong with them, one line per problem.

Every problem names the field path as a user writes it (`spec.deepspeed.zeroStage`)
and the reason (`must be <= 3`). A manifest is judged as the API server judges it:
YAML read as kubectl reads it, values typed as JSON types them (no "yes" for true,
no "5" for 5), nulls dropped as the API server prunes them, and the same cross-field
rules the CRD enforces with CEL (see api.SPEC_RULES). No input makes this raise
anything but ManifestError or OSError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from kubetrain.core.api import API_VERSION, KIND, OWN_ERROR, PATTERN_REASONS, SWEEP_KIND, TrainingJob, TrainingSweep
from kubetrain.core.pod_template import MAX_DEPTH
from kubetrain.core.sweep import space

MAX_MANIFEST_BYTES = 1_572_864
"""1.5 MiB, etcd's default limit for one object: a bigger manifest cannot be stored anyway."""
MAX_VALUES = 1_000_000
"""Values in one document once YAML aliases are expanded (an alias "bomb" expands to billions)."""
INT64 = 2**63


@dataclass(frozen=True)
class Problem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class ManifestError(Exception):
    """A manifest that cannot be turned into a TrainingJob (or TrainingSweep); `problems` says why."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


_SIMPLE_REASONS = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _reason(err: ErrorDetails) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in _SIMPLE_REASONS:
        return _SIMPLE_REASONS[kind]
    if kind == OWN_ERROR:
        return str(err["msg"])
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "string_pattern_mismatch":
        return PATTERN_REASONS.get(str(ctx.get("pattern")), f"must match {ctx.get('pattern')}")
    if kind in ("string_too_short", "too_short"):
        unit = "characters" if kind.startswith("string") else "items"
        return f"must have at least {ctx.get('min_length')} {unit}"
    if kind in ("string_too_long", "too_long"):
        unit = "characters" if kind.startswith("string") else "items"
        return f"must have at most {ctx.get('max_length')} {unit}"
    return str(err["msg"]).lower()


# --------------------------------------------------------------------------- YAML as kubectl reads it


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, typed as kubectl's YAML reader types plain scalars: `1e18` and `3e-4` are
    numbers (YAML 1.2; PyYAML alone makes them strings) and timestamps stay strings."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(  # after PyYAML's int and float: catches what they leave, `1e18`
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _yaml_problem(exc: Exception) -> str:
    """One line for any error PyYAML raises (its own messages span several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"not valid YAML: {exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, RecursionError):
        return "not valid YAML: nested too deeply"
    return "not valid YAML: " + " ".join(str(exc).split())


def load_documents(path: Path) -> list[Any]:
    """The documents of a YAML file; ManifestError when it is too big, not UTF-8 or not YAML."""
    with Path(path).open("rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(str(path), [Problem("(file)", "larger than 1.5 MiB, the most the API server stores")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(str(path), [Problem("(file)", f"not UTF-8 text (byte {exc.start})")]) from None
    try:
        return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except Exception as exc:  # noqa: BLE001 - PyYAML raises more than YAMLError on hostile input
        raise ManifestError(str(path), [Problem("(file)", _yaml_problem(exc))]) from None


# --------------------------------------------------------------------------- values as the API server has them


class _Unacceptable(Exception):
    def __init__(self, loc: tuple[int | str, ...], reason: str):
        super().__init__(reason)
        self.problem = Problem(_path(loc), reason)


def _key(key: Any) -> str:
    """A mapping key as YAML-to-JSON conversion writes it (`1` -> "1", `true` -> "true")."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    return str(key)


def _scalar(value: Any, loc: tuple[int | str, ...]) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise _Unacceptable(loc, "must fit in 64 bits")
        return value
    if isinstance(value, float):  # the API server's decoder reads 5.0 as the integer 5
        return int(value) if value.is_integer() and abs(value) < INT64 else value
    return str(value)  # dates and binaries from explicit tags: kubectl sends them as strings


def as_json(doc: Any) -> Any:
    """The document as the API server decodes it: JSON types, string keys, null fields pruned.

    _Unacceptable names the first place where it is nested too deeply or expands to too many values.
    """
    budget = [MAX_VALUES]

    def walk(node: Any, loc: tuple[int | str, ...]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unacceptable((), f"more than {MAX_VALUES} values (YAML aliases expand to too many)")
        if len(loc) > MAX_DEPTH:
            raise _Unacceptable(loc[:2], f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            return {_key(k): walk(v, (*loc, _key(k))) for k, v in node.items() if v is not None}
        if isinstance(node, list | tuple):
            return [walk(v, (*loc, i)) for i, v in enumerate(node)]
        return _scalar(node, loc)

    return walk(doc, ())


# --------------------------------------------------------------------------- judging one document


def _as_submitted(doc: Any, kind: str) -> tuple[Any, list[Problem]]:
    """The document as the API server has it, or None and why it is not a `kind` manifest at all."""
    if not isinstance(doc, dict):
        return None, [Problem("(root)", f"must be a mapping (a {kind} manifest)")]
    found: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        found.append(Problem("apiVersion", f"must be {API_VERSION}"))
    if doc.get("kind") != kind:
        found.append(Problem("kind", f"must be {kind}"))
    if found:
        return None, found
    try:
        return as_json(doc), []
    except _Unacceptable as exc:
        return None, [exc.problem]


def _errors(exc: ValidationError) -> list[Problem]:
    return [Problem(_path(e["loc"]), _reason(e)) for e in exc.errors()]


def check(doc: Any) -> tuple[TrainingJob | None, list[Problem]]:
    """The TrainingJob of one parsed manifest document, or None and every problem it has."""
    plain, found = _as_submitted(doc, KIND)
    if plain is None:
        return None, found
    if "spec" not in plain:  # the CRD requires it; the model has a default for code that builds jobs
        found.append(Problem("spec", "required"))
    try:
        job = TrainingJob.model_validate_json(json.dumps(plain), strict=True)
    except ValidationError as exc:
        return None, found + _errors(exc)
    found += [Problem(f"spec.{path}", message) for path, message in job.spec.rule_violations()]
    return (None if found else job), found


def check_sweep(doc: Any) -> tuple[TrainingSweep | None, list[Problem]]:
    """The TrainingSweep of one parsed manifest document, or None and every problem it has.

    Beyond its schema and rules: every parameter must name a scalar field of a TrainingJob spec, and
    each of its bounds or values must give the template a valid spec (see sweep.space.check_space).
    """
    plain, found = _as_submitted(doc, SWEEP_KIND)
    if plain is None:
        return None, found
    try:
        sweep = TrainingSweep.model_validate_json(json.dumps(plain), strict=True)
    except ValidationError as exc:
        return None, _errors(exc)
    found = [Problem(f"spec.{path}", reason) for path, reason in space.check_space(sweep.spec)]
    return (None if found else sweep), found


Stored = TypeVar("Stored", TrainingJob, TrainingSweep)


def stored_object(model: type[Stored], body: Mapping[str, Any]) -> tuple[Stored | None, list[str]]:
    """An object the API server accepted, as `model`; else None and the problems its schema could not express
    (the Python-only rules, and objects stored before a field got stricter). Metadata beyond name, namespace,
    labels and annotations is not read."""
    meta = body.get("metadata") or {}
    data: dict[str, Any] = {k: body.get(k) for k in ("apiVersion", "kind", "spec") if body.get(k) is not None}
    data["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace"),
                        "labels": meta.get("labels"), "annotations": meta.get("annotations")}
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        return None, [f"{_path(e['loc'])}: {_reason(e)}" for e in exc.errors()]
    problems = [f"spec.{p}: {m}" for p, m in obj.spec.rule_violations()]
    return (None if problems else obj), problems


def problems_of(doc: Any) -> list[Problem]:
    """Every problem of one parsed manifest document (a TrainingSweep when its kind says so, else a
    TrainingJob); empty when it is valid."""
    if isinstance(doc, dict) and doc.get("kind") == SWEEP_KIND:
        return check_sweep(doc)[1]
    return check(doc)[1]


def _single(path: Path, kind: str) -> Any:
    docs = load_documents(path)
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == kind] or docs
    if len(found) != 1:
        raise ManifestError(str(path), [Problem("(file)", f"must hold exactly one {kind}, found {len(found)}")])
    return found[0]


def load_job(path: Path) -> TrainingJob:
    """The single TrainingJob in a manifest file, or ManifestError naming every problem."""
    job, problems = check(_single(path, KIND))
    if job is None:
        raise ManifestError(str(path), problems)
    return job


def load_sweep(path: Path) -> TrainingSweep:
    """The single TrainingSweep in a manifest file, or ManifestError naming every problem."""
    sweep, problems = check_sweep(_single(path, SWEEP_KIND))
    if sweep is None:
        raise ManifestError(str(path), problems)
    return sweep
