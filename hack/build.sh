#!/usr/bin/env bash
# Build the test-cluster binaries from the pinned Go modules under hack/.
#
#   hack/build.sh [component...]     (default: all)
#
# Components: etcd kwok kube-apiserver kube-controller-manager kube-scheduler kubectl
#   and, for the real node: kubelet kube-proxy coredns local-path-provisioner pause
#   and, only when named, the host services: seaweedfs (the `weed` binary) registry
# Output: ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/<component>-<version>/<component>
# A component is rebuilt only when its directory is missing, i.e. when the
# version pinned in hack/<module>/go.mod changes. Go's own module and build
# caches (GOMODCACHE, GOCACHE) stay at their default locations outside the tree.
# Parallelism: GOFLAGS=-p=N (Go's default is the CPU count).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

ALL=("${CONTROL_PLANE[@]}" "${REAL_NODE_PARTS[@]}" "${HOST_SERVICES[@]}")
want=("$@")
[[ ${#want[@]} -gt 0 ]] || want=("${ALL[@]}")

missing() {  # prints the wanted components whose binary is absent
  local c
  for c in "$@"; do [[ -x "$(bin_path "$c")" ]] || echo "$c"; done
}

# go_build <module dir> <ldflags> <component>=<package>...
# One `go build -o FILE` per binary: compiled packages are shared through
# GOCACHE, and the binary name does not depend on the package path
# (go.etcd.io/etcd/server/v3 would otherwise come out as "server").
go_build() {
  local dir="$1" ldflags="$2"; shift 2
  local spec name pkg out start
  for spec in "$@"; do
    name="${spec%%=*}" pkg="${spec#*=}" out="$(bin_path "${spec%%=*}")"
    log "building ${name} from ${pkg} (module hack/$(basename "$dir")) ..."
    start=$SECONDS
    mkdir -p "$(dirname "$out")"
    (cd "$dir" && go build -trimpath -ldflags "-s -w ${ldflags}" -o "${out}.tmp" "$pkg")
    mv "${out}.tmp" "$out"
    log "  built ${out} in $((SECONDS - start))s"
  done
}

mkdir -p "${KUBETRAIN_BIN_CACHE}"
# One build at a time (.ci/run starts one in the background that cluster-up may meet): the second waits,
# then finds the binaries there. Both would write the same output files.
exec 9>"${KUBETRAIN_BIN_CACHE}/.build.lock"
flock 9
todo=()
mapfile -t todo < <(missing "${want[@]}")
if [[ ${#todo[@]} -eq 0 ]]; then
  log "all binaries up to date in ${KUBETRAIN_BIN_CACHE}"
  exit 0
fi
total_start=$SECONDS
command -v go >/dev/null || die "building ${todo[*]} needs Go >= 1.26 on PATH (https://go.dev/dl/)"
go_minor="$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')"
[[ -z "$go_minor" || "$go_minor" -ge 26 ]] || die "Go >= 1.26 needed, found $(go env GOVERSION)"
log "building ${todo[*]} with $(go env GOVERSION) (cold: about 10 min on 2 cores)"

k8s_todo=()
for c in "${todo[@]}"; do
  case "$c" in
    etcd)
      go_build "${HACK_DIR}/etcd" "" "etcd=go.etcd.io/etcd/server/v3" ;;
    kwok)
      v="$(kwok_version)"
      go_build "${HACK_DIR}/kwok" "-X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}" \
        "kwok=sigs.k8s.io/kwok/cmd/kwok" ;;
    coredns)
      go_build "${HACK_DIR}/coredns" "" "coredns=." ;;
    local-path-provisioner)
      go_build "${HACK_DIR}/local-path" "" "local-path-provisioner=github.com/rancher/local-path-provisioner" ;;
    pause)
      go_build "${HACK_DIR}/pause" "" "pause=." ;;
    seaweedfs)  # a big module: 15.5 min cold on 2 cores (GOFLAGS=-p=2, busy machine)
      go_build "${HACK_DIR}/seaweedfs" "" "seaweedfs=github.com/seaweedfs/seaweedfs/weed" ;;
    registry)
      go_build "${HACK_DIR}/registry" "-X github.com/distribution/distribution/v3/version.version=$(registry_version)" \
        "registry=github.com/distribution/distribution/v3/cmd/registry" ;;
    kube-*|kubectl|kubelet) k8s_todo+=("$c=k8s.io/kubernetes/cmd/$c") ;;
  esac
done

if [[ ${#k8s_todo[@]} -gt 0 ]]; then
  v="$(k8s_version)"
  minor="${v#v1.}"; minor="${minor%%.*}"
  commit="$(cd "${HACK_DIR}/k8s" && go mod download -json "k8s.io/kubernetes@${v}" \
    | python3 -c 'import json,sys; print((json.load(sys.stdin).get("Origin") or {}).get("Hash", ""))')"
  ld=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${p}.gitVersion=${v} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor}"
    ld+=" -X ${p}.gitTreeState=clean -X ${p}.buildDate=1970-01-01T00:00:00Z"
    [[ -z "$commit" ]] || ld+=" -X ${p}.gitCommit=${commit}"
  done
  go_build "${HACK_DIR}/k8s" "$ld" "${k8s_todo[@]}"
fi
log "build finished in $((SECONDS - total_start))s"
