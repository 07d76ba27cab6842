"""Load TrainingJob manifests and explain what is wrong with them, one line per problem.

Every problem names the field path as a user writes it (`spec.deepspeed.zeroStage`)
and the reason (`must be <= 3`). The same cross-field rules the CRD enforces with
CEL are checked here (see api.SPEC_RULES).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from kubetrain.core.api import API_VERSION, KIND, TrainingJob


@dataclass(frozen=True)
class Problem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class ManifestError(Exception):
    """A manifest that cannot be turned into a TrainingJob; `problems` says why."""

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
            out += ("." if out else "") + part
    return out or "(root)"


def _reason(err: ErrorDetails) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    simple = {
        "missing": "required",
        "extra_forbidden": "unknown field",
        "int_type": "must be an integer",
        "int_parsing": "must be an integer",
        "int_from_float": "must be an integer",
        "float_type": "must be a number",
        "float_parsing": "must be a number",
        "bool_type": "must be true or false",
        "bool_parsing": "must be true or false",
        "string_type": "must be a string",
        "list_type": "must be a list",
        "dict_type": "must be a mapping",
        "model_type": "must be a mapping",
        "model_attributes_type": "must be a mapping",
        "string_pattern_mismatch": "must be a lowercase DNS label (a-z, 0-9, '-')",
    }
    if kind in simple:
        return simple[kind]
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, key = bounds[kind]
        return f"must be {op} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "string_too_short":
        return f"must have at least {ctx.get('min_length')} characters"
    if kind == "string_too_long":
        return f"must have at most {ctx.get('max_length')} characters"
    return str(err["msg"]).lower()


def problems_of(doc: Any) -> list[Problem]:
    """Every problem of one parsed manifest document; empty when it is a valid TrainingJob."""
    if not isinstance(doc, dict):
        return [Problem("(root)", "must be a mapping (a TrainingJob manifest)")]
    found: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        found.append(Problem("apiVersion", f"must be {API_VERSION}"))
    if doc.get("kind") != KIND:
        found.append(Problem("kind", f"must be {KIND}"))
    if found:
        return found
    try:
        job = TrainingJob.model_validate(doc)
    except ValidationError as exc:
        return [Problem(_path(e["loc"]), _reason(e)) for e in exc.errors()]
    return [Problem(f"spec.{path}", message) for path, message in job.spec.rule_violations()]


def load_documents(path: Path) -> list[Any]:
    text = Path(path).read_text()
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(str(path), [Problem("(file)", f"not valid YAML: {exc}")]) from exc


def load_job(path: Path) -> TrainingJob:
    """The single TrainingJob in a manifest file, or ManifestError naming every problem."""
    docs = load_documents(path)
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND] or docs
    if len(jobs) != 1:
        raise ManifestError(str(path), [Problem("(file)", f"must hold exactly one TrainingJob, found {len(jobs)}")])
    problems = problems_of(jobs[0])
    if problems:
        raise ManifestError(str(path), problems)
    return TrainingJob.model_validate(jobs[0])
