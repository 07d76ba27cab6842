"""Load TrainingJob and TrainingSweep manifests and explain what is wrong with them, one line per problem.

Every problem names the field path as a user writes it (`spec.deepspeed.zeroStage`)
and the reason (`must be <= 3`). A manifest is judged as the API server judges it:
YAML read as kubectl reads it (see plain_tag; a repeated key or a tag beyond YAML's core
ones is refused), every document and every item of a List on its own, a generateName
named first, values typed as JSON types them (no "true" for true, no "5" for 5), nulls
dropped as the API server prunes them, and the same cross-field rules the CRD enforces
with CEL (see api.SPEC_RULES). No input makes this raise anything but ManifestError or OSError.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from kubetrain.core import runtimes
from kubetrain.core.api import (
    API_VERSION,
    CLUSTER_RUNTIME_KIND,
    DAEMON_IMAGE_RULE,
    KIND,
    OWN_ERROR,
    PATTERN_REASONS,
    RUNTIME_KIND,
    SWEEP_KIND,
    ClusterTrainingRuntime,
    ObjectMeta,
    RuntimeMeta,
    SweepMeta,
    TrainingJob,
    TrainingRuntime,
    TrainingSweep,
)
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


_TAG = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, MAP, SEQ, MERGE = (_TAG + t for t in ("str", "int", "float", "bool", "null", "map", "seq",
                                                                   "merge"))
CORE_TAGS: Final = (STR, INT, FLOAT, BOOL, NULL, MAP, SEQ)
"""The only tags a manifest may carry: the others (`!!binary`, `!!timestamp`, `!!set`, `!!python/...`, local `!x`)
mean different values to different YAML readers, or none."""
_BOOLS = {**dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), True),
          **dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), False)}
_NULLS = ("", "~", "null", "Null", "NULL")
_SPECIAL_FLOATS = {**dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
                   **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf),
                   **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan)}
_INT = re.compile(r"[-+]?(0[bB][01]+|0[oO][0-7]+|0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
"""Go's strconv.ParseInt(s, 0, 64): binary, octal (`0o17`, and C's `017`), hex, decimal."""
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def plain_tag(value: str) -> str:
    """The tag kubectl's YAML reader gives an untagged plain scalar.

    kubectl reads YAML with sigs.k8s.io/yaml, that is go-yaml v2: YAML 1.1's booleans (`yes`, `on`, `y`, `off`, ...)
    and C's octal `0777` as PyYAML has them, but no base-60 numbers (`1:30` stays a string, where PyYAML reads 90),
    Go's integers (`0o17`, `0x1F`, `0b101`, `1_000`), numbers with an exponent and no dot (`1e18`, a string to
    PyYAML), and no timestamps (`2024-01-01` reaches the API server as a string)."""
    if value in _NULLS:
        return NULL
    if value in _BOOLS:
        return BOOL
    if value in _SPECIAL_FLOATS:
        return FLOAT
    if value == "<<":
        return MERGE
    if value[:1] == ".":
        return FLOAT if _FLOAT.fullmatch(value) else STR
    if value[:1] in ("+", "-") or value[:1].isdigit():
        plain = value.replace("_", "")  # go-yaml drops digit separators before it parses a number
        if _INT.fullmatch(plain):
            return INT
        if _FLOAT.fullmatch(plain):
            return FLOAT
    return STR


def _to_int(text: str) -> int:
    """An integer as go-yaml reads one (its range is as_json's to judge)."""
    plain = text.replace("_", "")
    if not _INT.fullmatch(plain):
        raise ValueError(text)
    sign, digits = (-1 if plain[0] == "-" else 1), plain.lstrip("+-")
    if digits[0] == "0" and digits[1:2].isdigit():  # `017`: Go reads a leading 0 as octal, Python refuses it
        return sign * int(digits, 8)
    return sign * int(digits, 0)


def _to_float(text: str) -> float:
    if text in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[text]
    plain = text if text[:1] == "." else text.replace("_", "")
    if _INT.fullmatch(plain):  # `!!float 0x10`
        return float(_to_int(plain))
    if not _FLOAT.fullmatch(plain):
        raise ValueError(text)
    return float(plain)


def _to_bool(text: str) -> bool:
    if text not in _BOOLS:
        raise ValueError(text)
    return _BOOLS[text]


def _to_null(text: str) -> None:
    if text not in _NULLS:
        raise ValueError(text)


_SCALARS: dict[str, Callable[[str], Any]] = {STR: str, INT: _to_int, FLOAT: _to_float, BOOL: _to_bool, NULL: _to_null}


def _short(tag: str) -> str:
    return "!!" + tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag


def _scalar_constructor(convert: Callable[[str], Any]) -> Callable[[yaml.SafeLoader, yaml.Node], Any]:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        try:
            return convert(node.value)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r} as {_short(node.tag)}", node.start_mark) from None
    return construct


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading plain scalars as kubectl does (plain_tag) and building YAML's core types only."""

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0]:
            return plain_tag(value)
        return str(super().resolve(kind, value, implicit))


_Loader.yaml_constructors = {tag: c for tag, c in yaml.SafeLoader.yaml_constructors.items() if tag in (MAP, SEQ, None)}
for _tag, _convert in _SCALARS.items():
    _Loader.add_constructor(_tag, _scalar_constructor(_convert))


def _yaml_problem(exc: Exception) -> str:
    """One line for any error PyYAML raises (its own messages span several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"not valid YAML: {exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, RecursionError):
        return "not valid YAML: nested too deeply"
    return "not valid YAML: " + " ".join(str(exc).split())


def _key_of(node: yaml.Node) -> tuple[str, Any]:
    """A mapping key as go-yaml compares keys: by type and value (`1` and `"1"` differ, `yes` and `true` do not)."""
    if isinstance(node, yaml.ScalarNode) and node.tag in _SCALARS:
        try:
            return node.tag, _SCALARS[node.tag](node.value)
        except ValueError:
            pass  # construction says why
    return node.tag, id(node)


def _node_problems(root: yaml.Node) -> list[tuple[yaml.Mark, Problem]]:
    """Each tag beyond the core ones and each key a mapping repeats (kubectl refuses both), at its path; a node
    reached again through an alias is seen once, and one deeper than MAX_DEPTH is as_json's to refuse."""
    found: list[tuple[yaml.Mark, Problem]] = []
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, tuple[int | str, ...]]] = [(root, ())]
    while todo:
        node, loc = todo.pop()
        if id(node) in seen or len(loc) > MAX_DEPTH:
            continue
        seen.add(id(node))
        if node.tag not in CORE_TAGS and not (node.tag == MERGE and isinstance(node, yaml.ScalarNode)):
            found.append((node.start_mark, Problem(_path(loc), f"tag {_short(node.tag)} (line {node.start_mark.line + 1}) "
                          "is not one of YAML's core tags (!!str, !!int, !!float, !!bool, !!null, !!map, !!seq): "
                          "YAML readers disagree on what the others mean")))
        elif isinstance(node, yaml.SequenceNode):
            todo += [(item, (*loc, i)) for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            found += _duplicates(node, loc)
            for key, value in node.value:
                at = loc if key.tag == MERGE else (*loc, _key(_key_of(key)[1]))  # merged keys are this mapping's
                todo += [(key, at), (value, at)]
    return found


def _duplicates(node: yaml.MappingNode, loc: tuple[int | str, ...]) -> list[tuple[yaml.Mark, Problem]]:
    found, keys = [], set()
    for key, _ in node.value:
        if key.tag == MERGE:
            continue  # `<<: *base`: the keys written beside it win over the merged ones, as YAML means them to
        identity = _key_of(key)
        if identity in keys:
            found.append((key.start_mark, Problem(_path((*loc, _key(identity[1]))),
                                                  f"duplicate key (line {key.start_mark.line + 1}): kubectl refuses "
                                                  "a mapping that sets a key twice")))
        keys.add(identity)
    return found


def _read_text(path: Path) -> str:
    with Path(path).open("rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(str(path), [Problem("(file)", "larger than 1.5 MiB, the most the API server stores")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(str(path), [Problem("(file)", f"not UTF-8 text (byte {exc.start})")]) from None


def _compose_and_construct(text: str) -> tuple[list[Any], list[tuple[yaml.Mark, Problem]]]:
    """The documents, or what kubectl's YAML reader refuses in them (the whole file then, as kubectl applies none)."""
    loader = _Loader(text)
    try:
        docs, found = [], []
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            problems = _node_problems(node)
            found += problems
            if not found:
                docs.append(loader.construct_document(node))
        return docs, found
    finally:
        loader.dispose()


def load_documents(path: Path) -> list[Any]:
    """The documents of a YAML file, read as kubectl reads them (see plain_tag); ManifestError when the file is too
    big, not UTF-8, not YAML, or holds what kubectl's reader refuses (a repeated key) or misreads (other tags)."""
    text = _read_text(path)
    try:
        docs, found = _compose_and_construct(text)
    except Exception as exc:  # noqa: BLE001 - PyYAML raises more than YAMLError on hostile input
        raise ManifestError(str(path), [Problem("(file)", _yaml_problem(exc))]) from None
    if found:
        raise ManifestError(str(path), [p for _, p in sorted(found, key=lambda mp: mp[0].index)])
    return [d for d in docs if d is not None]


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
        if not math.isfinite(value):  # anywhere, free-form fields too: JSON, what kubectl sends, has neither
            raise _Unacceptable(loc, "must be a finite number")
        return int(value) if value.is_integer() and abs(value) < INT64 else value
    return str(value)  # not reached: the loader builds YAML's core types only


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
        plain = as_json(doc)
    except _Unacceptable as exc:
        return None, [exc.problem]
    return plain, _name_from_generate_name(plain, _METADATA[kind])


GENERATED_NAME_CHARACTERS: Final = 5
"""The API server names an object that has metadata.generateName and no name: generateName + 5 random characters."""
GENERATE_NAME_PATTERN = r"[a-z][-a-z0-9]*"
"""A generateName whose name (with 5 random letters and digits after it) is a DNS-1035 label (api.JOB_NAME_PATTERN)."""
_METADATA: dict[str, type[ObjectMeta]] = {KIND: ObjectMeta, SWEEP_KIND: SweepMeta, RUNTIME_KIND: RuntimeMeta,
                                          CLUSTER_RUNTIME_KIND: RuntimeMeta}


def _name_from_generate_name(plain: dict[str, Any], meta: type[ObjectMeta]) -> list[Problem]:
    """Name an object that has generateName and no name, as the API server does before it validates one; here
    the name is generateName without its last '-' (a local run of it keeps one output directory), so
    generateName itself must leave room for the random characters. Problems with generateName, if any."""
    metadata = plain.get("metadata")
    if not isinstance(metadata, dict) or metadata.get("name") or not metadata.get("generateName"):
        return []
    prefix = metadata["generateName"]
    longest = next(m.max_length for m in meta.model_fields["name"].metadata if getattr(m, "max_length", None))
    room = longest - GENERATED_NAME_CHARACTERS
    why = f"the API server appends {GENERATED_NAME_CHARACTERS} random characters to make the name"
    if not isinstance(prefix, str):
        reason = "must be a string"
    elif len(prefix) > room:
        reason = f"must have at most {room} characters ({why}, which has at most {longest})"
    elif not re.fullmatch(GENERATE_NAME_PATTERN, prefix):
        reason = f"must start with a lowercase letter and hold only a-z, 0-9 and '-' ({why}, a DNS-1035 label)"
    else:
        metadata["name"] = prefix.rstrip("-")
        return []
    metadata["name"] = "generated"  # a valid stand-in: the problem is generateName's, said once
    return [Problem("metadata.generateName", reason)]


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
        return None, found + _errors(exc)
    found += [Problem(f"spec.{path}", reason) for path, reason in space.check_space(sweep.spec)]
    return (None if found else sweep), found


RUNTIME_MODELS: Final = {RUNTIME_KIND: TrainingRuntime, CLUSTER_RUNTIME_KIND: ClusterTrainingRuntime}


def check_runtime(doc: Any) -> tuple[TrainingRuntime | ClusterTrainingRuntime | None, list[Problem]]:
    """The TrainingRuntime or ClusterTrainingRuntime of one parsed manifest document, or None and every problem."""
    kind = _kind(doc)
    plain, found = _as_submitted(doc, kind)
    if plain is None:
        return None, found
    try:
        runtime = RUNTIME_MODELS[kind].model_validate_json(json.dumps(plain), strict=True)
    except ValidationError as exc:
        return None, found + _errors(exc)
    for text in runtimes.runtime_problems(runtime.spec):
        path, _, reason = text.partition(": ")
        found.append(Problem(path, reason))
    return (None if found else runtime), found


def with_runtime(job: TrainingJob, docs: list[Any]) -> tuple[TrainingJob | None, list[Problem]]:
    """A job over the runtime its spec.runtimeRef names, taken from the same file's documents (a local run has
    no cluster to read it from); a job without one as it is."""
    ref = job.spec.runtime_ref
    if ref is None:
        return job, []
    found = [d for d in docs if _kind(d) == ref.kind and isinstance(d.get("metadata"), dict)
             and d["metadata"].get("name") == ref.name]
    if not found:
        return None, [Problem("spec.runtimeRef", f"{ref.kind} {ref.name!r} is not in this file: outside a cluster "
                              "the runtime comes from the job's own manifest (add its document, after ---)")]
    runtime, problems = check_runtime(found[0])
    if runtime is None:
        return None, [Problem("spec.runtimeRef", f"{ref.kind} {ref.name!r}: {p}") for p in problems]
    resolved = runtimes.resolve(job.spec, ref.kind, ref.name, runtime.spec)
    if resolved.spec is None:
        return None, [Problem(*text.split(": ", 1)) for text in resolved.problems]
    return job.model_copy(update={"spec": resolved.spec}), []


Stored = TypeVar("Stored", TrainingJob, TrainingSweep)


def stored_object(model: type[Stored], body: Mapping[str, Any]) -> tuple[Stored | None, list[str], list[str]]:
    """An object the API server accepted, as `model`; else None and the problems its schema could not express
    (the Python-only rules, and objects stored before a field got stricter). Metadata beyond name, namespace,
    labels, annotations and uid (the run's identity, which fences its checkpoints) is not read.

    Spec fields `model` does not know are set apart, not refused (their paths, third): they come from a CRD
    newer than this code, as the API server fills in a new field's default on every object it returns, and an
    operator not yet upgraded must tell them from a bad spec rather than fail every job that runs. The object
    is validated once when there are none."""
    data = _stored_data(body)
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
    else:
        # A daemon image a job names itself is the operator's to refuse, before the job starts (admission_problems):
        # one stored before that rule must not fail while it runs.
        problems = [f"spec.{p}: {m}" for p, m in obj.spec.rule_violations() if p != DAEMON_IMAGE_RULE.path]
        return (None if problems else obj), problems, []
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden" and e["loc"][:1] == ("spec",)]
    if not unknown:
        return None, [f"{_path(e['loc'])}: {_reason(e)}" for e in errors], []
    data["spec"] = copy.deepcopy(data["spec"])  # the caller's body stays as stored
    for loc in unknown:
        parent: Any = data
        for part in loc[:-1]:
            parent = parent[part]
        del parent[loc[-1]]
    known, problems, _ = stored_object(model, data)
    return known, problems, [_path(loc) for loc in unknown]


def _stored_data(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    data: dict[str, Any] = {k: body.get(k) for k in ("apiVersion", "kind", "spec") if body.get(k) is not None}
    data["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace"),
                        "labels": meta.get("labels"), "annotations": meta.get("annotations"), "uid": meta.get("uid")}
    return data


def problems_of(doc: Any, docs: list[Any] | None = None) -> list[Problem]:
    """Every problem of one parsed manifest document (a TrainingSweep or a runtime when its kind says so, else a
    TrainingJob, checked over its runtime where `docs`, the file's documents, hold it); empty when it is valid."""
    if isinstance(doc, dict) and doc.get("kind") == SWEEP_KIND:
        return check_sweep(doc)[1]
    if _kind(doc) in RUNTIME_MODELS:
        return check_runtime(doc)[1]
    job, found = check(doc)
    ref = job.spec.runtime_ref if job is not None else None
    if ref is None or not any(_kind(d) == ref.kind and (d.get("metadata") or {}).get("name") == ref.name
                              for d in docs or [] if isinstance(d, dict)):
        return found
    return with_runtime(job, docs or [])[1]


# --------------------------------------------------------------------------- judging a file, as kubectl sends it


KINDS: Final = (KIND, SWEEP_KIND, RUNTIME_KIND, CLUSTER_RUNTIME_KIND)


def _kind(doc: Any) -> Any:
    return doc.get("kind") if isinstance(doc, dict) else None


def is_list(doc: Any) -> bool:
    """A `kind: List` (or `<Kind>List`) document: kubectl sends each of its items as an object of its own."""
    return isinstance(doc, dict) and str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list)


@dataclass(frozen=True)
class Verdict:
    """What `kubetrain validate` says of one object of a file."""

    document: int | None
    """The index of its document, in a file of several."""
    item: int | None
    """Its index in a List."""
    obj: Any
    problems: list[Problem] = field(default_factory=list)
    """Their paths start with items[<item>] in a List."""
    checked: bool = True
    """False: an object of another kind beside TrainingJobs or TrainingSweeps, left to its own API."""

    def source(self, file: str) -> str:
        return file if self.document is None else f"{file}[{self.document}]"

    def summary(self) -> str:
        """The line for an object without problems."""
        where = "" if self.item is None else f"items[{self.item}]: "
        meta = self.obj.get("metadata") or {}  # a mapping: the others have problems
        name = repr(meta.get("name") or "") if meta.get("name") or not meta.get("generateName") \
            else f"generateName {meta['generateName']!r}"
        return f"{where}{'valid' if self.checked else 'not checked (not a kubetrain kind):'} {self.obj.get('kind')} {name}"


def _inside(item: int | None, problems: list[Problem]) -> list[Problem]:
    if item is None:
        return problems
    return [Problem(f"items[{item}]" + ("" if p.path == "(root)" else f".{p.path}"), p.reason) for p in problems]


def judge(docs: list[Any]) -> list[Verdict]:
    """Every object of a file's documents judged as the API server judges it, a List's items one by one (as kubectl
    sends them). Beside a TrainingJob or TrainingSweep, objects of other kinds are not checked (kubectl sends them
    to their own APIs); in a file with neither, each object is judged as a TrainingJob: its problems say why not."""
    several = len(docs) > 1
    found = [Verdict(i if several else None, j, obj) for i, doc in enumerate(docs)
             for j, obj in (enumerate(doc["items"]) if is_list(doc) else [(None, doc)])]
    ours = any(_kind(v.obj) in KINDS for v in found)
    return [replace(v, checked=False) if ours and _kind(v.obj) and _kind(v.obj) not in KINDS
            else replace(v, problems=_inside(v.item, problems_of(v.obj, [x.obj for x in found]))) for v in found]


def _single(path: Path, kind: str) -> Any:
    """The one `kind` document of a file (a file of one other document: that one, judged as a `kind`)."""
    docs = load_documents(path)
    found = [d for d in docs if _kind(d) == kind] or (docs if len(docs) == 1 else [])
    if len(found) != 1:
        raise ManifestError(str(path), [Problem("(file)", f"must hold exactly one {kind}, found {len(found)}")])
    if is_list(found[0]):
        raise ManifestError(str(path), [Problem("(file)", f"holds a {found[0]['kind']}: give the {kind} on its own "
                                                          "(kubetrain validate checks every item of a List)")])
    return found[0]


def load_job(path: Path) -> TrainingJob:
    """The single TrainingJob in a manifest file, over the runtime its spec.runtimeRef names (a document of the same
    file), or ManifestError naming every problem."""
    job, problems = check(_single(path, KIND))
    if job is not None:
        job, problems = with_runtime(job, load_documents(path))
    if job is None:
        raise ManifestError(str(path), problems)
    return job


def load_sweep(path: Path) -> TrainingSweep:
    """The single TrainingSweep in a manifest file, or ManifestError naming every problem."""
    sweep, problems = check_sweep(_single(path, SWEEP_KIND))
    if sweep is None:
        raise ManifestError(str(path), problems)
    return sweep
