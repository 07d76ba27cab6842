# shellcheck shell=bash
# Common settings for the hack/ scripts. Source it; do not run it.
#
# Everything built or started lives OUTSIDE the work tree, under
# KUBETRAIN_CACHE (default: ~/.cache/kubetrain):
#   bin/<component>-<version>/<component>   built binaries, one dir per pin
#   cluster/                                state of the running test cluster

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${HACK_DIR}/.." && pwd)"
KUBETRAIN_CACHE="${KUBETRAIN_CACHE:-${HOME}/.cache/kubetrain}"
KUBETRAIN_BIN_CACHE="${KUBETRAIN_CACHE}/bin"
KUBETRAIN_CLUSTER_DIR="${KUBETRAIN_CLUSTER_DIR:-${KUBETRAIN_CACHE}/cluster}"
# Never let a dependency's `toolchain` line download another Go.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# module_version <module dir> <module path>: the version that dir's go.mod pins.
module_version() {
  (cd "$1" && go mod edit -json | python3 -c '
import json, sys
want = sys.argv[1]
for r in json.load(sys.stdin).get("Require") or []:
    if r["Path"] == want:
        print(r["Version"])
        break
else:
    sys.exit("not required: " + want)
' "$2")
}

k8s_version() { module_version "${HACK_DIR}/k8s" k8s.io/kubernetes; }
etcd_version() { module_version "${HACK_DIR}/etcd" go.etcd.io/etcd/server/v3; }
kwok_version() { module_version "${HACK_DIR}/kwok" sigs.k8s.io/kwok; }
coredns_version() { module_version "${HACK_DIR}/coredns" github.com/coredns/coredns; }
local_path_version() { module_version "${HACK_DIR}/local-path" github.com/rancher/local-path-provisioner; }
seaweedfs_version() { module_version "${HACK_DIR}/seaweedfs" github.com/seaweedfs/seaweedfs; }
registry_version() { module_version "${HACK_DIR}/registry" github.com/distribution/distribution/v3; }
# pause is ours (hack/pause): its version is a hash of its source, so an edit rebuilds it.
pause_version() { cat "${HACK_DIR}"/pause/go.mod "${HACK_DIR}"/pause/main.go | sha256sum | cut -c1-12; }

# go_tool <module dir> <module> <package> <name> [--path | --module-dir]: a peer's binary (Kubeflow,
# Kueue) pinned by a `tool` line in <module dir>/go.mod, built once per pin into
# ${KUBETRAIN_BIN_CACHE}/<name>-<version>/<name>; prints its path. --path: only where it is (or would
# be); --module-dir: the module's directory in GOMODCACHE (downloaded if needed), for its manifests.
go_tool() {
  local dir="$1" module="$2" pkg="$3" name="$4" v out start
  v="$(module_version "$dir" "$module")"
  out="${KUBETRAIN_BIN_CACHE}/${name}-${v}/${name}"
  case "${5:-}" in
    --path) echo "$out"; return 0 ;;
    --module-dir)
      (cd "$dir" && go mod download -json "${module}@${v}") \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
      return 0 ;;
    "") ;;
    *) die "usage: $0 [--path | --module-dir]" ;;
  esac
  if [[ ! -x "$out" ]]; then
    command -v go >/dev/null || die "building ${name} needs Go >= 1.26 on PATH"
    log "building ${name} ${v} from ${pkg} (module ${dir#"${REPO_ROOT}/"}; cold: a few minutes) ..."
    start=$SECONDS
    mkdir -p "$(dirname "$out")"
    (cd "$dir" && go build -trimpath -ldflags "-s -w" -o "${out}.tmp" "$pkg")
    mv "${out}.tmp" "$out"
    log "  built ${out} in $((SECONDS - start))s"
  fi
  echo "$out"
}

# bin_path <component>: where build.sh puts that component's binary.
bin_path() {
  local c="$1" v name=""
  case "$c" in
    kube-apiserver|kube-controller-manager|kube-scheduler|kubectl|kubelet|kube-proxy) v="$(k8s_version)" ;;
    etcd|etcdctl) v="$(etcd_version)" ;;
    kwok) v="$(kwok_version)" ;;
    coredns) v="$(coredns_version)" ;;
    local-path-provisioner) v="$(local_path_version)" ;;
    pause) v="$(pause_version)" ;;
    seaweedfs) v="$(seaweedfs_version)" name=weed ;;
    registry) v="$(registry_version)" ;;
    *) die "unknown component: $c" ;;
  esac
  printf '%s/%s-%s/%s\n' "${KUBETRAIN_BIN_CACHE}" "$c" "$v" "${name:-$c}"
}

# pid_alive <pid>: the process exists and is not a zombie (some init processes
# reap exited children only every second or two).
pid_alive() {
  local state
  kill -0 "$1" 2>/dev/null || return 1
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
  [[ "$state" != Z ]]
}

# What hack/build.sh builds: the control plane, and the real node's parts.
CONTROL_PLANE=(etcd kwok kube-apiserver kube-controller-manager kube-scheduler kubectl)
REAL_NODE_PARTS=(kubelet kube-proxy coredns local-path-provisioner pause)
HOST_SERVICES=(seaweedfs registry)  # the object store and the image registry (hack/objectstore.sh, hack/registry.sh)

# The real node (kubelet + containerd on this machine). Its containerd keeps its
# content and snapshots under NODE_ROOT across cluster-down, so images loaded by
# `make images` stay until they change.
KUBETRAIN_NODE_ROOT="${KUBETRAIN_NODE_ROOT:-/var/lib/kubetrain-node}"
KUBETRAIN_NODE_RUN="${KUBETRAIN_NODE_RUN:-/run/kubetrain-node}"
CONTAINERD_SOCK="${KUBETRAIN_NODE_RUN}/containerd/containerd.sock"
# Pods live on this bridge; the API server, kubelet and DNS answer on its address.
NODE_BRIDGE="${KUBETRAIN_NODE_BRIDGE:-ktbr0}"
NODE_POD_CIDR="10.88.0.0/16"
NODE_IP="10.88.0.1"
SERVICE_CIDR="10.96.0.0/16"
PAUSE_IMAGE="docker.io/kubetrain/pause:1.0"
ctr_node() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
