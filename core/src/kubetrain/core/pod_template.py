"""What a job's spec.podTemplate may put into its worker pods.

The podTemplate is merged over the pod kubetrain builds, so it could otherwise undo what kubetrain
owns (the pod's name, namespace, owner, its `kubetrain.io/` labels and annotations, which worker runs
where) or reach the host (privileged containers, hostPath volumes, host namespaces and ports, added
capabilities, another ServiceAccount's rights). Three checks, each naming the field and the reason:

- shape: the podTemplate is a partial core/v1 PodTemplateSpec (mappings and lists where the API has
  them), so that no value of the wrong kind reaches the pod builder;
- owned: fields kubetrain owns are refused in every cluster;
- host: host-level fields are refused unless the operator's PodPolicy (the platform admin's chart
  values) allows them; a fabric profile's own needs are the operator's to add, never the podTemplate's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubetrain.core import contract

Problem = tuple[str, str]
"""(spec-relative path, reason)."""

OWNED_METADATA = ("name", "generateName", "namespace", "ownerReferences", "finalizers", "uid",
                  "resourceVersion", "creationTimestamp", "deletionTimestamp", "managedFields")
OWNED_PREFIX = contract.LABEL_JOB.split("/")[0] + "/"
"""kubetrain's label and annotation prefix (`kubetrain.io/`): job, index, generation, progress, profile."""
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
MAPPINGS = ("securityContext", "resources", "affinity", "nodeSelector", "dnsConfig", "overhead")
"""PodSpec fields that are objects (a list, a number or a string there is refused)."""
LISTS = ("volumes", "tolerations", "imagePullSecrets", "hostAliases", "topologySpreadConstraints",
         "readinessGates", "resourceClaims", "schedulingGates", *CONTAINER_LISTS)
"""PodSpec fields that are lists of objects."""
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
"""Capabilities the Pod Security `baseline` profile lets a container add: never host-level."""
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
MAX_DEPTH = 100
"""Nesting deeper than any pod template needs: the pod builder's merge recurses over it."""


@dataclass(frozen=True)
class PodPolicy:
    """The host-level fields a podTemplate may set, decided by the platform admin (chart values
    `podPolicy.*`, the operator's KUBETRAIN_POD_POLICY). Everything is refused by default."""

    allow_privileged: bool = False
    """`securityContext.privileged: true` on a container."""
    allow_host_path: bool = False
    """`hostPath` volumes."""
    allow_host_namespaces: bool = False
    """`hostNetwork`, `hostPID`, `hostIPC`, and containers' `hostPort`s."""
    allowed_capabilities: frozenset[str] = field(default_factory=frozenset)
    """Capabilities a container may add beyond Pod Security `baseline`'s and the fabric profile's."""
    allow_service_account: bool = False
    """`serviceAccountName`: worker pods run as another ServiceAccount, with its rights."""


def _is_map(value: Any) -> bool:
    return isinstance(value, Mapping)


def _map(value: Any) -> Mapping[str, Any]:
    """The value where it is a mapping, else an empty one (shape_problems names it)."""
    return value if isinstance(value, Mapping) else {}


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether mappings and lists nest deeper than `limit` (walked without recursion: the object may be hostile)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [x for v in level for x in (v.values() if _is_map(v) else v if isinstance(v, list) else ())]
        if not level:
            return False
    return True


def shape_problems(template: Any) -> list[Problem]:
    """Values of the wrong kind: where the API has an object or a list of objects, nothing else."""
    if not _is_map(template):
        return [("podTemplate", "must be a mapping: a partial PodTemplateSpec (metadata, spec)")]
    if _too_deep(template):
        return [("podTemplate", f"nested more than {MAX_DEPTH} levels deep")]
    found = [(f"podTemplate.{k}", "unknown field: a PodTemplateSpec has metadata and spec") for k in template
             if k not in ("metadata", "spec")]
    for part in ("metadata", "spec"):
        if part in template and not _is_map(template[part]):
            found.append((f"podTemplate.{part}", "must be a mapping"))
    meta, spec = template.get("metadata"), template.get("spec")
    if _is_map(meta):
        for kind in ("labels", "annotations"):
            notes = meta.get(kind)
            if notes is not None and (not _is_map(notes) or not all(isinstance(v, str) for v in notes.values())):
                found.append((f"podTemplate.metadata.{kind}", "must map names to strings"))
    if _is_map(spec):
        found += _spec_shape(spec)
    return found


def _spec_shape(spec: Mapping[str, Any]) -> list[Problem]:
    found = [(f"podTemplate.spec.{k}", "must be a mapping") for k in MAPPINGS if k in spec and not _is_map(spec[k])]
    for k in LISTS:
        if k in spec and (not isinstance(spec[k], list) or not all(_is_map(x) for x in spec[k])):
            found.append((f"podTemplate.spec.{k}", "must be a list of mappings"))
    for at, c in _containers(spec):
        for k in ("securityContext", "resources"):
            if k in c and not _is_map(c[k]):
                found.append((f"{at}.{k}", "must be a mapping"))
        for k in ("env", "ports", "volumeMounts"):
            if k in c and (not isinstance(c[k], list) or not all(_is_map(x) for x in c[k])):
                found.append((f"{at}.{k}", "must be a list of mappings"))
    return found


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, container) of every container the spec lists, whatever its list."""
    for kind in CONTAINER_LISTS:
        items = spec.get(kind)
        if isinstance(items, list):
            yield from ((f"podTemplate.spec.{kind}[{i}]", c) for i, c in enumerate(items) if _is_map(c))


def owned_problems(template: Mapping[str, Any]) -> list[Problem]:
    """Fields kubetrain owns: refused in every cluster (they would move a worker, forge its progress, or
    detach it from its job)."""
    meta, spec = _map(template.get("metadata")), _map(template.get("spec"))
    found = [(f"podTemplate.metadata.{k}", "is set by kubetrain for each worker pod") for k in OWNED_METADATA
             if k in meta]
    for kind in ("labels", "annotations"):
        found += [(f"podTemplate.metadata.{kind}[{k}]", f"{OWNED_PREFIX} {kind} are kubetrain's own")
                  for k in _map(meta.get(kind)) if str(k).startswith(OWNED_PREFIX)]
    if "nodeName" in spec:
        found.append(("podTemplate.spec.nodeName", "would bypass the scheduler and any queue: use "
                      "scheduling.nodeSelector or podTemplate.spec.affinity"))
    return found


def service_account_key(template: Mapping[str, Any]) -> str | None:
    """The field by which the podTemplate names the workers' ServiceAccount (`serviceAccountName`, or its old
    name `serviceAccount`), None where it names none."""
    spec = _map(template.get("spec"))
    return next((k for k in ("serviceAccountName", "serviceAccount") if spec.get(k)), None)


def host_problems(template: Mapping[str, Any], policy: PodPolicy, fabric_capabilities: frozenset[str]) -> list[Problem]:
    """Host-level fields the policy does not allow, each with the PodPolicy setting that would."""
    spec = _map(template.get("spec"))
    found: list[Problem] = []
    if not policy.allow_host_namespaces:
        found += [(f"podTemplate.spec.{k}", _refused("shares the node's namespace", "allowHostNamespaces"))
                  for k in HOST_NAMESPACES if spec.get(k) is True]
    if not policy.allow_host_path:
        found += [(f"podTemplate.spec.volumes[{i}].hostPath", _refused("mounts a directory of the node", "allowHostPath"))
                  for i, v in enumerate(spec.get("volumes") or []) if _is_map(v) and "hostPath" in v]
    key = service_account_key(template)
    if not policy.allow_service_account and key is not None:
        found.append((f"podTemplate.spec.{key}", _refused("runs the workers with another ServiceAccount's rights",
                                                          "allowServiceAccount")))
    allowed = BASELINE_CAPABILITIES | fabric_capabilities | policy.allowed_capabilities
    for at, c in _containers(spec):
        found += _container_host_problems(at, c, policy, allowed)
    return found


def _container_host_problems(at: str, c: Mapping[str, Any], policy: PodPolicy, allowed: frozenset[str]) -> list[Problem]:
    found: list[Problem] = []
    sc = _map(c.get("securityContext"))
    if sc.get("privileged") is True and not policy.allow_privileged:
        found.append((f"{at}.securityContext.privileged", _refused("gives the container the whole node", "allowPrivileged")))
    caps = _map(sc.get("capabilities"))
    extra = sorted(str(x) for x in (caps.get("add") or []) if str(x).removeprefix("CAP_") not in allowed)
    if extra:
        found.append((f"{at}.securityContext.capabilities.add",
                      _refused(f"adds {', '.join(extra)}, beyond Pod Security baseline and the fabric's",
                               "allowedCapabilities")))
    if not policy.allow_host_namespaces:
        found += [(f"{at}.ports[{i}].hostPort", _refused("opens a port on the node", "allowHostNamespaces"))
                  for i, p in enumerate(c.get("ports") or []) if _is_map(p) and p.get("hostPort")]
    return found


def _refused(what: str, setting: str) -> str:
    return f"{what}: not allowed by this cluster's operator (chart value podPolicy.{setting})"


MERGE_BY_NAME = frozenset({"containers", "initContainers", "volumes", "env", "volumeMounts", "ports"})
"""Lists of a pod whose items a podTemplate merges by `name`."""
REPLACED_WHOLE = frozenset({"env"})
"""Of those, the lists whose items replace the base's item of their name whole: an EnvVar holds a value or a
valueFrom, never both, so merging a `value` over a `valueFrom` would make one the API server refuses."""


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Deep-merge `override` into `base` (new object): maps key by key, named lists by `name`, the rest replaced.
    How a podTemplate merges over the generated pod, and a job's over its runtime's."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if key in MERGE_BY_NAME and isinstance(base, list) and isinstance(override, list):
        out_list = list(base)
        index = {item.get("name"): i for i, item in enumerate(out_list) if isinstance(item, dict)}
        for item in override:
            name = item.get("name") if isinstance(item, dict) else None
            if name in index:
                i = index[name]
                out_list[i] = item if key in REPLACED_WHOLE else merge(out_list[i], item, key)
            else:
                out_list.append(item)
        return out_list
    return override
