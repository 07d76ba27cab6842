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

# module_version <module dir> <module path>: the version that dir's go.mod requires (read without Go:
# every build.sh, cluster-up and prebuild looks up each part's version, and `go mod edit -json` costs
# about half a second each on a busy machine).
module_version() {
  awk -v m="$2" '
    /^require[ \t]*\(/ { block = 1; next }
    block && /^\)/ { block = 0; next }
    (block && $1 == m) || ($1 == "require" && $2 == m) { print (block ? $2 : $3); found = 1; exit }
    END { if (!found) { print "not required: " m > "/dev/stderr"; exit 1 } }' "$1/go.mod"
}

k8s_version() { module_version "${HACK_DIR}/k8s" k8s.io/kubernetes; }
etcd_version() { module_version "${HACK_DIR}/etcd" go.etcd.io/etcd/server/v3; }
kwok_version() { module_version "${HACK_DIR}/kwok" sigs.k8s.io/kwok; }
coredns_version() { module_version "${HACK_DIR}/coredns" github.com/coredns/coredns; }
local_path_version() { module_version "${HACK_DIR}/local-path" github.com/rancher/local-path-provisioner; }
s3proxy_pin() { sed -n "s/^$1=//p" "${HACK_DIR}/s3proxy/pin"; }  # s3proxy_pin version|sha256
registry_version() { module_version "${HACK_DIR}/registry" github.com/distribution/distribution/v3; }
# pause is ours (hack/pause): its version is a hash of its source, so an edit rebuilds it.
pause_version() { cat "${HACK_DIR}"/pause/go.mod "${HACK_DIR}"/pause/main.go | sha256sum | cut -c1-12; }

# go_tool <module dir> <module> <package> <name> [--path | --module-dir]: a peer's binary (Kubeflow,
# Kueue) pinned by a `tool` line in <module dir>/go.mod, built once per pin into
# ${KUBETRAIN_BIN_CACHE}/<name>-<version>/<name>; prints its path. --path: only where it is (or would
# be); --module-dir: the module's directory in GOMODCACHE (downloaded if needed), for its manifests.
go_tool() {
  local dir="$1" module="$2" pkg="$3" name="$4" v out
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
  go_binary "$name" "$out" "$dir" "$pkg" ""
  echo "$out"
}

# ------------------------------------------------------------------ building, and saying so
# Every Go binary of the test cluster and its peers is built by go_binary: one builder per binary at a
# time (a lock per binary, so that a test waiting for one part does not wait for the others), and a
# line at least every PROGRESS_S seconds while it builds or waits, so no caller ever sits silent.
PROGRESS_S="${KUBETRAIN_PROGRESS_S:-30}"

# with_progress <what> <command...>: run the command, logging "still <what> (Ns)" every PROGRESS_S s.
with_progress() {
  local what="$1" start=$SECONDS next pid rc=0
  shift
  "$@" &
  pid=$!
  next=$((SECONDS + PROGRESS_S))
  while pid_alive "$pid"; do
    if ((SECONDS >= next)); then
      log "  still ${what} ($((SECONDS - start))s so far)"
      next=$((SECONDS + PROGRESS_S))
    fi
    sleep 1
  done
  wait "$pid" || rc=$?
  return "$rc"
}

# lock_owner <lock file>: who holds it, as its holder wrote it ("<pid> <epoch> <what>").
lock_owner() {
  local pid since what
  read -r pid since what <"$1.owner" 2>/dev/null || { echo "held by another build"; return 0; }
  echo "held by pid ${pid} (${what:-a build}) for $(($(date +%s) - since))s"
}

# take_lock <fd> <lock file> <what>: flock it, saying every PROGRESS_S s what it waits for and for how long.
take_lock() {
  local fd="$1" lock="$2" what="$3" start=$SECONDS
  if ! flock -n "$fd"; then
    log "waiting for ${what}: $(lock_owner "$lock")"
    until flock -w "$PROGRESS_S" "$fd"; do
      log "  still waiting for ${what} ($((SECONDS - start))s so far; $(lock_owner "$lock"))"
    done
    log "  ${what}: waited $((SECONDS - start))s"
  fi
  echo "$$ $(date +%s) ${KUBETRAIN_BUILD_OWNER:-$0}" >"${lock}.owner"
}

# once_locked <name> <out> <command...>: run <command> (which makes <out>) unless <out> is there, under
# <out>'s lock: a second builder waits, then finds it made.
once_locked() {
  local name="$1" out="$2" lock fd
  shift 2
  [[ -f "$out" ]] && return 0
  mkdir -p "$(dirname "$out")"
  lock="$(dirname "$out").lock"
  exec {fd}>>"$lock"
  take_lock "$fd" "$lock" "$name"
  if [[ -f "$out" ]]; then log "  ${name}: made meanwhile by the other build"; else "$@"; fi
  exec {fd}>&-
}

# go_binary <name> <out> <module dir> <package> <ldflags>: `go build` <package> into <out> unless it is
# there (once_locked). Compiled packages are shared through GOCACHE, modules through GOMODCACHE.
go_binary() {
  [[ -f "$2" ]] && return 0
  command -v go >/dev/null || die "building $1 needs Go >= 1.26 on PATH (https://go.dev/dl/)"
  once_locked "$1" "$2" _go_binary_now "$@"
}

_go_binary_now() {
  local name="$1" out="$2" dir="$3" pkg="$4" ldflags="$5" start=$SECONDS
  log "building ${name} from ${pkg} (module ${dir#"${REPO_ROOT}/"}) ..."
  with_progress "building ${name}" go_build_in "$dir" "$ldflags" "${out}.tmp" "$pkg" \
    || die "building ${name} failed (go build ${pkg} in ${dir#"${REPO_ROOT}/"})"
  mv "${out}.tmp" "$out"
  log "  built ${out} in $((SECONDS - start))s"
}

# maven_jar <name> <out> <path under the repository> <sha256>: a jar fetched from Maven Central (or
# KUBETRAIN_MAVEN_URL) into <out> unless it is there (once_locked), checked against <sha256>.
maven_jar() {
  once_locked "$1" "$2" _maven_jar_now "$@"
}

_maven_jar_now() {
  local name="$1" out="$2" url="${KUBETRAIN_MAVEN_URL:-https://repo1.maven.org/maven2}/$3" sum="$4" start=$SECONDS
  log "fetching ${name} from ${url} ..."
  with_progress "fetching ${name}" curl -fsSL --retry 3 -o "${out}.tmp" "$url" || die "fetching ${name} failed: ${url}"
  echo "${sum}  ${out}.tmp" | sha256sum -c --status \
    || { rm -f "${out}.tmp"; die "${name}: ${url} is not the pinned file (sha256 ${sum})"; }
  mv "${out}.tmp" "$out"
  log "  fetched ${out} ($(du -m "$out" | cut -f1) MiB) in $((SECONDS - start))s"
}

# The compiler's garbage collector at GOGC=400 (unless GOGC is set): a cold kwok build took 80.6 s instead of
# 94.5 s (user CPU 129 s instead of 154 s; 800: 77.4 s) at the same peak memory, 1.1 GB.
go_build_in() {  # go_build_in <module dir> <ldflags> <out> <package>
  cd "$1" && GOGC="${GOGC:-400}" go build -trimpath -ldflags "-s -w $2" -o "$3" "$4"
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
    s3proxy) v="$(s3proxy_pin version)" name=s3proxy.jar ;;
    registry) v="$(registry_version)" ;;
    helm) v="$(module_version "${HACK_DIR}/helm" helm.sh/helm/v4)" ;;
    kueue) v="$(module_version "${HACK_DIR}/kueue" sigs.k8s.io/kueue)" ;;
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
HOST_SERVICES=(s3proxy registry)  # the object store and the image registry (hack/objectstore.sh, hack/registry.sh)
# hack/prebuild.sh's order, by what stands on the run's longest path: S3Proxy (the e2e object-store tests;
# fetched in seconds), the cluster (the integration tier, the long pole, waits for it; cluster-up builds in
# this same order), then helm (the chart's tests, run at the end of their tiers: the unit tier's after the
# e2e tier), then Kueue (its tests come last). helm and kueue are built on first use otherwise
# (hack/helm/build.sh, hack/kueue/build.sh).
PREBUILD_ORDER=(s3proxy "${CONTROL_PLANE[@]}" "${REAL_NODE_PARTS[@]}" registry helm kueue)

# The real nodes (kubelet + containerd on this machine): KUBETRAIN_REAL_NODES of them (default 2).
# Node 1, `kubetrain-node`, lives in this machine's network namespace; node k >= 2,
# `kubetrain-node-k`, in a network namespace of its own with its own bridge, pod range and
# kube-proxy, joined to the host by a veth pair. KUBETRAIN_NODE_INDEX (default 1) says which node
# the node scripts (real-node.sh, containerd.sh) act on. Each node's containerd keeps its content
# and snapshots under its root across cluster-down, so images loaded by `make images` stay until
# they change.
REAL_NODES="${KUBETRAIN_REAL_NODES:-2}"
NODE_INDEX="${KUBETRAIN_NODE_INDEX:-1}"
KUBETRAIN_NODE_ROOT="${KUBETRAIN_NODE_ROOT:-/var/lib/kubetrain-node}"
KUBETRAIN_NODE_RUN="${KUBETRAIN_NODE_RUN:-/run/kubetrain-node}"
CLUSTER_POD_RANGE="10.80.0.0/12"  # every node's pod range and the host-node links: pods route it via their node
node_suffix() { ((${1} == 1)) || printf -- '-%s' "$1"; }
# NODE_EXEC: what runs a program in the selected node's network namespace as the same process (no fork, so
# `NODE_EXEC... prog &` leaves the program's pid in $!); the mount namespace stays, unlike `ip netns exec`,
# which remounts /sys and would hide the cgroup hierarchy from the kubelet. Empty for node 1.
node_exec() { NODE_EXEC=(); [[ -z "$NODE_NETNS" ]] || NODE_EXEC=(nsenter --no-fork --net="/run/netns/${NODE_NETNS}"); }
node_vars() {  # node_vars <k>: the NODE_* settings of real node k
  local k="$1"
  NODE_NAME="kubetrain-node$(node_suffix "$k")"
  NODE_ROOT="${KUBETRAIN_NODE_ROOT}$(node_suffix "$k")"
  NODE_RUN="${KUBETRAIN_NODE_RUN}$(node_suffix "$k")"
  CONTAINERD_SOCK="${NODE_RUN}/containerd/containerd.sock"
  NODE_POD_CIDR="10.$((87 + k)).0.0/16"
  NODE_IP="10.$((87 + k)).0.1"
  NODE_BRIDGE_MAC="02:6b:74:00:00:$(printf '%02x' "$k")"  # locally administered (02:), "kt"
  if ((k == 1)); then
    NODE_BRIDGE="${KUBETRAIN_NODE_BRIDGE:-ktbr0}" NODE_NETNS="" NODE_LINK="" NODE_LINK_HOST="" NODE_LINK_NODE=""
  else
    NODE_BRIDGE="ktbr$((k - 1))" NODE_NETNS="kubetrain-node-${k}" NODE_LINK="ktnode${k}"
    NODE_LINK_HOST="10.87.${k}.1" NODE_LINK_NODE="10.87.${k}.2"
  fi
  node_exec
}
node_vars "$NODE_INDEX"
# Node 1's address: the API server's forward, CoreDNS, the object store and the registry answer there for every node's pods.
HOST_NODE_IP="10.88.0.1"
in_node() { ${NODE_EXEC[@]+"${NODE_EXEC[@]}"} "$@"; }  # in_node <command...>: in the selected node's network
SERVICE_CIDR="10.96.0.0/16"
PAUSE_IMAGE="docker.io/kubetrain/pause:1.0"
ctr_node() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
