#!/usr/bin/env bash
# Build the test-cluster binaries from the pinned Go modules under hack/.
#
#   hack/build.sh [component...]     (default: the cluster's: control plane, real node, host services)
#
# Components: etcd kwok kube-apiserver kube-controller-manager kube-scheduler kubectl
#   and, for the real node: kubelet kube-proxy coredns local-path-provisioner pause
#   and the host services: s3proxy (a jar fetched from Maven Central: hack/s3proxy/pin) registry
#   and, only when named, the tools the tests use: helm kueue (also hack/helm/build.sh, hack/kueue/build.sh)
# Output: ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/<component>-<version>/<component>
# A component is rebuilt only when its directory is missing, i.e. when the
# version pinned in hack/<module>/go.mod changes. Go's own module and build
# caches (GOMODCACHE, GOCACHE) stay at their default locations outside the tree.
# Parallelism: GOFLAGS=-p=N (Go's default is the CPU count).
# Each component has a lock of its own (lib.sh go_binary): a second build.sh (hack/prebuild.sh in the
# background, cluster-up, a test's fixture) waits for the component the first is building, saying so
# every 30 s, then finds it built. Every component prints a line when it starts, when it is built (with
# its time) and what is left; a build in progress says so every 30 s (KUBETRAIN_PROGRESS_S).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

ALL=("${CONTROL_PLANE[@]}" "${REAL_NODE_PARTS[@]}" "${HOST_SERVICES[@]}")
want=("$@")
[[ ${#want[@]} -gt 0 ]] || want=("${ALL[@]}")

missing() {  # prints the wanted components whose binary is absent
  local c
  for c in "$@"; do [[ -f "$(bin_path "$c")" ]] || echo "$c"; done
}

k8s_ldflags() {  # the version stamps kube-* and kubectl report (`kubectl version`)
  local v minor commit p ld=""
  v="$(k8s_version)"
  minor="${v#v1.}"; minor="${minor%%.*}"
  commit="$(cd "${HACK_DIR}/k8s" && go mod download -json "k8s.io/kubernetes@${v}" \
    | python3 -c 'import json,sys; print((json.load(sys.stdin).get("Origin") or {}).get("Hash", ""))')"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${p}.gitVersion=${v} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor}"
    ld+=" -X ${p}.gitTreeState=clean -X ${p}.buildDate=1970-01-01T00:00:00Z"
    [[ -z "$commit" ]] || ld+=" -X ${p}.gitCommit=${commit}"
  done
  echo "$ld"
}

# build <component>: its module, package and version stamps.
build() {
  local c="$1" out v
  out="$(bin_path "$c")"
  case "$c" in
    etcd) go_binary "$c" "$out" "${HACK_DIR}/etcd" go.etcd.io/etcd/server/v3 "" ;;
    kwok)
      v="$(kwok_version)"
      go_binary "$c" "$out" "${HACK_DIR}/kwok" sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}" ;;
    coredns) go_binary "$c" "$out" "${HACK_DIR}/coredns" . "" ;;
    local-path-provisioner) go_binary "$c" "$out" "${HACK_DIR}/local-path" github.com/rancher/local-path-provisioner "" ;;
    pause) go_binary "$c" "$out" "${HACK_DIR}/pause" . "" ;;
    s3proxy)
      v="$(s3proxy_pin version)"
      maven_jar "$c" "$out" "org/gaul/s3proxy/${v}/s3proxy-${v}-jar-with-dependencies.jar" "$(s3proxy_pin sha256)" ;;
    registry)
      go_binary "$c" "$out" "${HACK_DIR}/registry" github.com/distribution/distribution/v3/cmd/registry \
        "-X github.com/distribution/distribution/v3/version.version=$(registry_version)" ;;
    helm)
      v="$(module_version "${HACK_DIR}/helm" helm.sh/helm/v4)"
      go_binary "$c" "$out" "${HACK_DIR}/helm" helm.sh/helm/v4/cmd/helm \
        "-X helm.sh/helm/v4/internal/version.version=${v} -X helm.sh/helm/v4/internal/version.gitTreeState=clean" ;;
    kueue) go_binary "$c" "$out" "${HACK_DIR}/kueue" sigs.k8s.io/kueue/cmd/kueue "" ;;
    kube-*|kubectl|kubelet)
      [[ -n "${K8S_LDFLAGS:-}" ]] || K8S_LDFLAGS="$(k8s_ldflags)"
      go_binary "$c" "$out" "${HACK_DIR}/k8s" "k8s.io/kubernetes/cmd/$c" "$K8S_LDFLAGS" ;;
    *) die "unknown component: $c" ;;
  esac
}

for c in "${want[@]}"; do bin_path "$c" >/dev/null; done  # an unknown name stops here
mkdir -p "${KUBETRAIN_BIN_CACHE}"
todo=()
mapfile -t todo < <(missing "${want[@]}")
if [[ ${#todo[@]} -eq 0 ]]; then
  log "all binaries up to date in ${KUBETRAIN_BIN_CACHE}"
  exit 0
fi
total_start=$SECONDS
if [[ "${todo[*]}" != s3proxy ]]; then  # every part but the fetched jar is a Go build
  command -v go >/dev/null || die "building ${todo[*]} needs Go >= 1.26 on PATH (https://go.dev/dl/)"
  go_minor="$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')"
  [[ -z "$go_minor" || "$go_minor" -ge 26 ]] || die "Go >= 1.26 needed, found $(go env GOVERSION)"
  log "building ${todo[*]} with $(go env GOVERSION)"
fi
for i in "${!todo[@]}"; do
  build "${todo[$i]}"
  left=("${todo[@]:$((i + 1))}")
  [[ ${#left[@]} -eq 0 ]] || log "  left: ${left[*]}"
done
log "build finished in $((SECONDS - total_start))s"
