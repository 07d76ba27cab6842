#!/usr/bin/env bash
# Build the operator and trainer images with buildah and load them into the real test node's
# containerd (the trainer image also into every other real node whose containerd runs), so pods
# start from them with imagePullPolicy IfNotPresent and no registry.
#
#   hack/images.sh [operator] [trainer]   build what changed and load it (default: both; `make images`)
#   hack/images.sh names                  print the two image names (the chart's defaults)
#   hack/images.sh check                  exit 0 when this machine can build them, else say what is missing
#   hack/images.sh buildah ARG...         buildah on this script's storage (images, inspect, run, rmi)
#   hack/images.sh ctr ARG...             ctr on the node's containerd, namespace k8s.io (images ls, run)
#   hack/images.sh registry               print REGISTRY: the test cluster's registry as the node reaches it
#   hack/images.sh fingerprint DOCKERFILE CONTEXT [EXTRA...]   print what a build's skip is decided on
#   hack/images.sh served REGISTRY REPOSITORY TAG   the digest REGISTRY serves for it, or nothing
#   hack/images.sh prune                  drop superseded images (every build ends with this; see Disk)
#
# When the test cluster's registry runs (hack/registry.sh, started by cluster-up), the images built are
# also pushed there as REGISTRY/kubetrain-operator:<tag> and REGISTRY/kubetrain-trainer:<tag> (zstd
# layers; unchanged layers are not sent again), the names docs/install.md installs from.
#
# Names: the chart's defaults (charts/kubetrain: image.repository:appVersion and trainerImage, the
# latter also the operator's default trainer image), so `helm install` with default values and a
# TrainingJob without spec.image find them on the node. The Dockerfiles are the product's own, built as
# they are; only their base image is made here, because no registry is reachable:
#   localhost/kubetrain/base:bookworm    debootstrap --variant=minbase + python3 (3.11), python3-venv,
#                                        python-is-python3, ca-certificates   (the operator's PYTHON_IMAGE
#                                        and the trainer's BASE_IMAGE, in place of their slim Python bases)
# The trainer's Dockerfile installs the torch and numpy pinned in requirements-dev.txt itself (its first
# stage), from a wheelhouse mounted at /wheels.
# Storage: buildah's overlay driver under $KUBETRAIN_NODE_ROOT/buildah (vfs would copy the multi-GB
# rootfs for every layer). Layers are cached (bud --layers). Before a build, a fingerprint of what it reads
# (its Dockerfile, build arguments, base image ID, the wheelhouse's file names and every file its COPY lines
# take from the context, with modes) is compared with the one kept from the image's last build
# ($KUBETRAIN_NODE_ROOT/image-stamps): the same, with that image still tagged, skips the build; a push
# is skipped while the registry serves the digest pushed last for that image ID. Each lane of a test
# run then checks in about a second what hack/prebuild.sh has just built.
# torch's wheels are kept in $KUBETRAIN_CACHE/wheels/torch-<version>, fetched once by the host's Python (pip's
# HTTP cache keeps nothing when a proxy strips the caching headers, as the one here does).
# Loading: skipped when the node's image has the same image ID (config digest); otherwise skopeo
# writes an OCI layout (uncompressed layers) whose blobs/ starts as hard links to containerd's own
# blobs, so only new layers are written, and only those go into `ctr images import`.
# Disk: every build ends by dropping what a rebuild superseded (GBs each time for the trainer): in
# buildah, the untagged images that are no step of a tagged one (the layer cache of the current builds
# stays); in each node's containerd, the images no tag names any more (`hack/images.sh prune` alone).
# Needs root, buildah, skopeo, debootstrap (for the first base) and containerd + ctr
# (hack/node-deps.sh installs them); starts the node's containerd (hack/containerd.sh) if needed.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

STORAGE_ROOT="${KUBETRAIN_NODE_ROOT}/buildah"
BLD=(buildah --root "${STORAGE_ROOT}" --runroot "${KUBETRAIN_NODE_RUN}/buildah" --storage-driver overlay)
WORK_TMP="${KUBETRAIN_NODE_ROOT}/tmp"  # next to containerd's content store: hard links need one filesystem
DEBIAN_MIRROR="${KUBETRAIN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_IMAGE="localhost/kubetrain/base:bookworm"
pin() { sed -n "s/^$1==//p" "${REPO_ROOT}/requirements-dev.txt"; }
TORCH_VERSION="$(pin torch)"
NUMPY_VERSION="$(pin numpy)"
WHEELHOUSE="${KUBETRAIN_CACHE}/wheels/torch-${TORCH_VERSION}"
# Build steps see the host's CA bundle (a TLS-inspecting proxy's CA included); images keep Debian's.
CA_MOUNT=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

# skopeo reads buildah's storage: `buildah push` (1.28) gzips every layer for an OCI layout, which
# neither reuses the layers containerd has nor is quick for torch's 5 GB.
STORAGE_REF="containers-storage:[overlay@${STORAGE_ROOT}+${KUBETRAIN_NODE_RUN}/buildah]"

bld() { "${BLD[@]}" "$@"; }

# qualify <ref>: the name as CRI normalises it (docker.io/ for Docker Hub names), since images
# are looked up by that name on the node.
qualify() {
  local first="${1%%/*}"
  if [[ "$1" != */* ]]; then echo "docker.io/library/$1"
  elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then echo "$1"
  else echo "docker.io/$1"; fi
}

# chart_images: "<operator> <trainer>" from the chart's default values.
chart_images() {
  python3 - "${REPO_ROOT}/charts/kubetrain" <<'PY'
import pathlib, re, sys
chart = pathlib.Path(sys.argv[1])
values, meta = (chart / "values.yaml").read_text(), (chart / "Chart.yaml").read_text()
def value(pattern: str, text: str) -> str:
    m = re.search(pattern, text, re.M)
    if not m:
        sys.exit(f"{chart}: no match for {pattern}")
    return m.group(1)
block = value(r"^image:\n((?:[ #].*\n)+)", values)
tag = value(r"^  tag: \"?([^\"\s]*)\"?", block) or value(r"^appVersion: \"?([^\"\s]+)\"?", meta)
repository = value(r"^  repository: (\S+)", block)
print(f"{repository}:{tag}", value(r"^trainerImage: (\S+)", values))
PY
}

TMPS=()
cleanup() { local d; for d in "${TMPS[@]}"; do rm -rf "$d"; done; }
trap cleanup EXIT
new_tmp() { mkdir -p "$WORK_TMP"; TMPS+=("$(mktemp -d "${WORK_TMP}/$1.XXXXXX")"); }

preflight() {
  local problems=() tools=() pkgs=() t
  [[ "$(id -u)" -eq 0 ]] || problems+=("root (overlay storage, chroot builds, the node's containerd socket; this is uid $(id -u))")
  for t in buildah skopeo ctr containerd debootstrap; do
    command -v "$t" >/dev/null || tools+=("$t")
  done
  # debootstrap only makes the base image: not needed once that exists.
  if [[ " ${tools[*]} " == *" debootstrap "* && ${#problems[@]} -eq 0 && ${#tools[@]} -eq 1 ]] && has_image "$BASE_IMAGE"; then
    tools=()
  fi
  for t in "${tools[@]}"; do [[ " ${pkgs[*]} " == *" ${t/ctr/containerd} "* ]] || pkgs+=("${t/ctr/containerd}"); done
  [[ ${#tools[@]} -eq 0 ]] || problems+=("${tools[*]} (Debian packages ${pkgs[*]}; hack/node-deps.sh installs them as root)")
  [[ ${#problems[@]} -eq 0 ]] || die "building the images needs ${problems[0]}${problems[1]:+ and ${problems[1]}}"
}

has_image() { bld inspect --type image "$1" >/dev/null 2>&1; }
image_id() { echo "sha256:$(bld inspect --type image --format '{{.FromImageID}}' "$1")"; }

STAMPS="${KUBETRAIN_NODE_ROOT}/image-stamps"
CHANGED=0  # 1 once this run builds, loads or pushes: only then is there anything to prune

# stamp_file <kind> <name>: where the fingerprint of <name>'s last build (kind fp) or push (kind push) is kept.
stamp_file() { echo "${STAMPS}/${2//[\/:]/_}.$1"; }

# fingerprint <dockerfile> <context> <extra>...: a digest of everything a build of <dockerfile> reads.
# COPY/ADD sources are walked as buildah takes them (minus the .dockerignore'd caches); a superset is
# harmless (a needless build check), a missed input would not be, so sources are whole directories.
fingerprint() {
  python3 - "$@" <<'PY'
import hashlib, os, re, sys
dockerfile, context, *extra = sys.argv[1:]
text = open(dockerfile).read()
h = hashlib.sha256(text.encode() + b"\0" + "\0".join(extra).encode())
sources = set()
for line in re.sub(r"\\\n", " ", text).splitlines():
    words = line.split()
    if words and words[0].upper() in ("COPY", "ADD") and not any(w.startswith("--from") for w in words):
        sources.update(w for w in words[1:-1] if not w.startswith("--"))
def skipped(name):
    return name == "__pycache__" or name.endswith((".pyc", ".egg-info"))
for source in sorted(sources):
    top = os.path.join(context, source)
    walk = os.walk(top) if os.path.isdir(top) else [(os.path.dirname(top), [], [os.path.basename(top)])]
    for where, dirs, files in walk:
        dirs[:] = sorted(d for d in dirs if not skipped(d))
        for name in sorted(f for f in files if not skipped(f)):
            path = os.path.join(where, name)
            st = os.lstat(path)
            h.update(f"{os.path.relpath(path, context)}\0{st.st_mode:o}\0".encode())
            h.update(os.readlink(path).encode() if os.path.islink(path) else open(path, "rb").read())
print(h.hexdigest())
PY
}

# bud <name> <dockerfile> <context> [buildah bud args...]: build with cached layers and tag <name>, unless
# its fingerprint is that of the tagged image's last build.
bud() {
  local name="$1" file="$2" context="$3" start=$SECONDS fp stamp id
  shift 3
  stamp="$(stamp_file fp "$name")"
  fp="$(fingerprint "$file" "$context" "$@" "base=$(image_id "$BASE_IMAGE")" \
        "wheels=$(ls "$WHEELHOUSE" 2>/dev/null | tr '\n' ' ')")"
  if has_image "$name" && id="$(image_id "$name")" && [[ "$(cat "$stamp" 2>/dev/null)" == "${fp} ${id}" ]]; then
    log "${name} is up to date (${id:0:19}): its inputs are those of its last build"
    return
  fi
  CHANGED=1
  log "building ${name} from ${file#"${REPO_ROOT}"/} ..."
  with_progress "building ${name}" bld bud --isolation chroot --network host --layers --pull=never \
    "${CA_MOUNT[@]}" "$@" -f "$file" -t "$name" "$context" >&2
  mkdir -p "$STAMPS"
  echo "${fp} $(image_id "$name")" > "$stamp"
  log "  ${name} is $(image_id "$name" | cut -c1-19) ($((SECONDS - start))s)"
}

debootstrap_base() {  # debootstrap_base <rootfs> <log>: its milestones on stderr, everything in <log>
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$1" "$DEBIAN_MIRROR" 2>&1 | tee "$2" \
    | { grep --line-buffered -E 'packages\.\.\.$|system\.\.\.$|successfully|^[WE]:' || true; } >&2
  return "${PIPESTATUS[0]}"
}

# The Debian base: made once (delete it with `hack/images.sh buildah rmi` to remake it).
build_base() {
  local start=$SECONDS dir rootfs ctr
  if has_image "$BASE_IMAGE"; then log "base ${BASE_IMAGE} present"; return; fi
  new_tmp base
  dir="${TMPS[-1]}" rootfs="${TMPS[-1]}/rootfs"
  log "making ${BASE_IMAGE} with debootstrap from ${DEBIAN_MIRROR} (1-2 min) ..."
  if ! with_progress "making ${BASE_IMAGE}" debootstrap_base "$rootfs" "${dir}/debootstrap.log"; then
    tail -n 20 "${dir}/debootstrap.log" >&2
    die "debootstrap failed (full log above: ${dir}/debootstrap.log is removed on exit)"
  fi
  rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/*
  : > "${rootfs}/etc/resolv.conf"  # debootstrap copies the host's; runtimes mount their own
  echo localhost > "${rootfs}/etc/hostname"
  ctr="$(bld from scratch)"
  cp -a "${rootfs}/." "$(bld mount "$ctr")/"
  bld umount "$ctr" >/dev/null
  bld config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --label org.opencontainers.image.title="kubetrain local base (Debian bookworm)" "$ctr"
  bld commit --quiet "$ctr" "$BASE_IMAGE" >/dev/null
  bld rm "$ctr" >/dev/null
  log "  ${BASE_IMAGE} made in $((SECONDS - start))s"
}

# fill_wheelhouse: PyPI's pinned torch and numpy (with the nvidia-* wheels torch needs) in WHEELHOUSE, fetched
# once by the host's Python (the base's is the same 3.11 on the same platform); the trainer's Dockerfile installs
# from it when it is mounted at /wheels, without the index.
fill_wheelhouse() {
  local stamp="${WHEELHOUSE}/.complete"
  [[ -f "$stamp" ]] && return 0
  mkdir -p "$WHEELHOUSE"
  log "torch ${TORCH_VERSION}: fetching ~2.5 GB of wheels into ${WHEELHOUSE} (once) ..."
  with_progress "fetching torch's wheels" python3 -m pip download --quiet --progress-bar off --only-binary=:all: \
    --python-version 3.11 --dest "$WHEELHOUSE" "torch==${TORCH_VERSION}" "numpy==${NUMPY_VERSION}" >&2
  touch "$stamp"
}

# node_image_id <name>: the image ID (config digest) of <name> in the node's containerd, or nothing.
node_image_id() {
  local manifest
  manifest="$(ctr_node images ls | awk -v n="$1" '$1 == n {print $3}')"
  [[ -n "$manifest" ]] || return 0
  ctr_node content get "$manifest" | python3 -c 'import json, sys; print(json.load(sys.stdin).get("config", {}).get("digest", ""))'
}

# image_blobs <oci layout>: the digests (hex) of its one image's manifest, config and layers, sorted
image_blobs() {
  python3 - "$1" <<'PY' | LC_ALL=C sort -u
import json, sys
root = sys.argv[1]
def blob(d): return open(f"{root}/blobs/sha256/{d.split(':')[1]}", "rb").read()
for m in json.load(open(f"{root}/index.json"))["manifests"]:
    manifest = json.loads(blob(m["digest"]))
    for d in [m["digest"], manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])]:
        print(d.split(":")[1])
PY
}

REGISTRY="${NODE_IP}:${KUBETRAIN_REGISTRY_PORT:-5000}"

# push_image <name> <repository>: the buildah image <name> to REGISTRY/<repository>:<name's tag>, when the
# registry answers (it is on this machine: plain HTTP). What is pushed is <name> plus one label, an image
# of its own ID: containerd 1.6's CRI keeps one name per image ID, so a node that pulled the registry's
# name of the very image `load_image` put there under the chart's default name would forget that name,
# and pods using it would fail with ErrImagePull. The label adds no layer: only the config differs.
push_image() {
  local ref="${REGISTRY}/$2:${1##*:}" start=$SECONDS
  local stamp served
  stamp="$(stamp_file push "$ref")"
  curl -fsS -o /dev/null --max-time 2 "http://${REGISTRY}/v2/" 2>/dev/null || {
    log "no registry at ${REGISTRY} (hack/registry.sh start): ${1} not pushed"; return 0; }
  served="$(registry_digest "$REGISTRY" "$2" "${1##*:}")"
  if [[ -n "$served" && "$(cat "$stamp" 2>/dev/null)" == "$(image_id "$1") ${served}" ]]; then
    log "${ref} is up to date (${served:0:19}): the registry serves what was pushed for this image"
    return
  fi
  CHANGED=1
  printf 'FROM %s\nLABEL io.kubetrain.published-to="%s"\n' "$1" "$REGISTRY" \
    | bld bud --isolation chroot --pull=never --layers -q -f - -t "$ref" "$REPO_ROOT" >/dev/null
  with_progress "pushing ${ref}" \
    skopeo copy -q --dest-tls-verify=false --dest-compress-format zstd "${STORAGE_REF}${ref}" "docker://${ref}"
  served="$(registry_digest "$REGISTRY" "$2" "${1##*:}")"
  mkdir -p "$STAMPS"
  [[ -z "$served" ]] || echo "$(image_id "$1") ${served}" > "$stamp"
  log "  pushed ${ref} ($(image_id "$ref" | cut -c1-19)) in $((SECONDS - start))s"
}

# registry_digest <registry> <repository> <tag>: the manifest digest the registry serves for it, or nothing
# (status 0 either way: a first push finds the tag unknown, a 404).
registry_digest() {
  local headers
  headers="$(curl -fsSI --max-time 5 -H "Accept: application/vnd.oci.image.manifest.v1+json" \
    -H "Accept: application/vnd.docker.distribution.manifest.v2+json" \
    "http://$1/v2/$2/manifests/$3" 2>/dev/null)" || return 0
  tr -d '\r' <<<"$headers" | awk -F': ' 'tolower($1) == "docker-content-digest" {print $2}'
}

import_blobs() {  # import_blobs <oci layout> <blob>...: the layout with only those blobs into the node's containerd
  local dir="$1"
  shift
  tar -C "$dir" -cf - oci-layout index.json "${@/#/blobs/sha256/}" | ctr_node images import - >&2
}

# load_image <name>: put the buildah image <name> into the selected node's containerd (lib.sh node_vars)
# unless it is there.
load_image() {
  local name="$1" id tmp start=$SECONDS new=() bytes=0
  local content=containerd/io.containerd.content.v1.content/blobs/sha256 src
  id="$(image_id "$name")"
  if [[ "$(node_image_id "$name")" == "$id" ]]; then
    log "${NODE_NAME} already has ${name} ($(cut -c1-19 <<<"$id")): not loaded"
    return
  fi
  CHANGED=1
  new_tmp load
  tmp="${TMPS[-1]}"
  mkdir -p "${tmp}/oci/blobs"
  # skopeo's OCI-layout writer skips a blob whose file exists: start from links to containerd's, this
  # node's and node 1's (which has them all once loaded: the other nodes' copy is then only links).
  mkdir -p "${tmp}/oci/blobs/sha256"
  for src in "${NODE_ROOT}/${content}" "${KUBETRAIN_NODE_ROOT}/${content}"; do
    if [[ -d "$src" ]]; then cp -al --no-clobber "$src/." "${tmp}/oci/blobs/sha256/" 2>/dev/null || true; fi
  done
  log "loading ${name} into ${NODE_NAME}'s containerd ..."
  with_progress "copying ${name} out of buildah's storage" \
    skopeo copy --dest-oci-accept-uncompressed-layers "${STORAGE_REF}${name}" "oci:${tmp}/oci:${name}" >&2
  # What the node lacks: the image's manifest, config and layers that its own content store has not.
  mapfile -t new < <(image_blobs "${tmp}/oci" | comm -23 - \
    <(find "${NODE_ROOT}/${content}" -type f -printf '%f\n' 2>/dev/null | LC_ALL=C sort))
  [[ ${#new[@]} -eq 0 ]] || bytes="$(cd "${tmp}/oci/blobs/sha256" && du -cb "${new[@]}" | tail -n 1 | cut -f1)"
  log "  importing ${#new[@]} new blobs ($((bytes / 1048576)) MiB) ..."
  with_progress "importing ${name} into ${NODE_NAME}'s containerd" import_blobs "${tmp}/oci" "${new[@]}"
  [[ "$(node_image_id "$name")" == "$id" ]] || die "${name}: the node's image is not ${id} after the import"
  log "  loaded ${name} in $((SECONDS - start))s"
}

# prune_buildah: remove the untagged images whose layers are no prefix of a tagged image's layers, i.e.
# neither a tagged image nor a cached step of one.
prune_buildah() {
  local ids=()
  mapfile -t ids < <(bld images --all --json | python3 -c '
import json, subprocess, sys
def layers(image_id):
    out = subprocess.run([*sys.argv[1:], "inspect", "--type", "image", "--format",
                          "{{json .Docker.RootFS.DiffIDs}}", image_id], capture_output=True, text=True)
    return json.loads(out.stdout or "null") or []
images = [(i["id"], bool(i.get("names")), layers(i["id"])) for i in json.load(sys.stdin)]
kept = [ls for _, tagged, ls in images if tagged]
for image_id, tagged, ls in images:
    if not tagged and not any(k[: len(ls)] == ls for k in kept):
        print(image_id)' "${BLD[@]}")
  [[ ${#ids[@]} -gt 0 ]] || return 0
  bld rmi "${ids[@]}" >/dev/null 2>&1 || true
  log "buildah: removed ${#ids[@]} superseded image(s)"
}

# prune_node: in the selected node's containerd, remove the references to images that no named tag
# (a name without @digest, not a bare sha256: id) points at any more; containerd then collects their blobs.
prune_node() {
  local stale=()
  mapfile -t stale < <(ctr_node images ls | awk 'NR > 1 {print $1, $3}' | python3 -c '
import sys
rows = [line.split() for line in sys.stdin.read().splitlines() if line.strip()]
named = {d for ref, d in rows if "@" not in ref and not ref.startswith("sha256:")}
print("\n".join(ref for ref, d in rows if d not in named))' | sed '/^$/d')
  [[ ${#stale[@]} -gt 0 ]] || return 0
  ctr_node images rm "${stale[@]}" >/dev/null 2>&1 || true
  log "${NODE_NAME}: removed ${#stale[@]} superseded image reference(s)"
}

prune_everywhere() {
  local k
  prune_buildah
  for ((k = 1; k <= REAL_NODES; k++)); do
    node_vars "$k"
    if [[ -S "$CONTAINERD_SOCK" ]] && ctr_node version >/dev/null 2>&1; then prune_node; fi
  done
  node_vars 1
}

# load_everywhere <name>: into node 1, and into every other real node whose containerd runs (those
# exist while the cluster is up; cluster-up's nodes get it from the next `make images`).
load_everywhere() {
  local k
  load_image "$1"
  for ((k = 2; k <= REAL_NODES; k++)); do
    node_vars "$k"
    if [[ -S "$CONTAINERD_SOCK" ]] && ctr_node version >/dev/null 2>&1; then load_image "$1"; fi
  done
  node_vars 1
}

main() {
  local want=("$@") operator trainer t start=$SECONDS
  case "${want[0]:-}" in
    check) preflight; return ;;
    buildah) exec "${BLD[@]}" "${want[@]:1}" ;;
    ctr) ctr_node "${want[@]:1}"; return ;;
    registry) echo "$REGISTRY"; return ;;
    fingerprint) fingerprint "${want[@]:1}"; return ;;
    served) registry_digest "${want[@]:1}"; return ;;
    prune) prune_everywhere; return ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; return ;;
  esac
  read -r operator trainer < <(chart_images)
  operator="$(qualify "$operator")" trainer="$(qualify "$trainer")"
  if [[ "${want[0]:-}" == names ]]; then printf 'operator %s\ntrainer %s\n' "$operator" "$trainer"; return; fi
  [[ ${#want[@]} -gt 0 ]] || want=(operator trainer)
  for t in "${want[@]}"; do
    [[ "$t" == operator || "$t" == trainer ]] || die "unknown image '$t' (operator, trainer, names, buildah ...)"
  done
  preflight
  # One build at a time: two at once (two test runs, a bench beside a test) would tag and load
  # over each other in one buildah storage.
  # A second one waits (saying so every 30 s: hack/prebuild.sh may be building them), then finds them built.
  mkdir -p "${KUBETRAIN_NODE_RUN}"
  exec 9>>"${KUBETRAIN_NODE_RUN}/images.lock"
  take_lock 9 "${KUBETRAIN_NODE_RUN}/images.lock" "the images (hack/images.sh)"
  bash "${HACK_DIR}/containerd.sh" start >/dev/null 9>&-  # containerd stays: it must not hold the lock
  build_base
  for t in "${want[@]}"; do
    case "$t" in
      operator) bud "$operator" "${REPO_ROOT}/Dockerfile" "$REPO_ROOT" --build-arg "PYTHON_IMAGE=${BASE_IMAGE}"
                load_image "$operator"
                push_image "$operator" kubetrain-operator ;;
      trainer) fill_wheelhouse
               bud "$trainer" "${REPO_ROOT}/trainer-image/Dockerfile" "$REPO_ROOT" --build-arg "BASE_IMAGE=${BASE_IMAGE}" \
                 -v "${WHEELHOUSE}:/wheels:ro" --build-arg "TORCH_VERSION=${TORCH_VERSION}" \
                 --build-arg "NUMPY_VERSION=${NUMPY_VERSION}"
               load_everywhere "$trainer"
               push_image "$trainer" kubetrain-trainer ;;
    esac
  done
  (( ! CHANGED )) || prune_everywhere
  log "images ready on the node in $((SECONDS - start))s: ${want[*]}"
}

main "$@"
