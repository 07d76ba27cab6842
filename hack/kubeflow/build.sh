#!/usr/bin/env bash
# Build Kubeflow Training Operator v1 (the PyTorchJob controller manager, cmd/training-operator.v1)
# from its Go module, pinned in hack/kubeflow/go.mod, into the same cache as the test-cluster binaries:
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/training-operator-<version>/training-operator
# A no-op when that file exists (i.e. until the pin changes). Used by bench/compare.py.
#
#   hack/kubeflow/build.sh                 build if missing, print the binary's path
#   hack/kubeflow/build.sh --path          only print where the binary is (or would be)
#   hack/kubeflow/build.sh --module-dir    print the module's directory in GOMODCACHE (downloads it if
#                                          needed): its manifests/base/{crds,rbac} are what bench/compare.py applies
#
# Only the Go module proxy is needed: no container registry, no GitHub. The module has no
# replace directives, so requiring it (a `tool` line) selects exactly the dependency versions
# of its own go.mod. Upstream builds the image with Go 1.23; go.mod keeps `godebug default=go1.23`.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../lib.sh"

MODULE_DIR="${HACK_DIR}/kubeflow"
MODULE=github.com/kubeflow/training-operator
v="$(module_version "${MODULE_DIR}" "${MODULE}")"
out="${KUBETRAIN_BIN_CACHE}/training-operator-${v}/training-operator"

case "${1:-}" in
  --path)
    echo "$out"
    exit 0 ;;
  --module-dir)
    (cd "${MODULE_DIR}" && go mod download -json "${MODULE}@${v}") \
      | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
    exit 0 ;;
  "") ;;
  *) die "usage: $0 [--path | --module-dir]" ;;
esac

if [[ ! -x "$out" ]]; then
  command -v go >/dev/null || die "building the training-operator needs Go >= 1.26 on PATH"
  log "building training-operator ${v} from ${MODULE}/cmd/training-operator.v1 (module hack/kubeflow; cold: a few minutes) ..."
  start=$SECONDS
  mkdir -p "$(dirname "$out")"
  (cd "${MODULE_DIR}" && go build -trimpath -ldflags "-s -w" -o "${out}.tmp" "${MODULE}/cmd/training-operator.v1")
  mv "${out}.tmp" "$out"
  log "  built ${out} in $((SECONDS - start))s"
fi
echo "$out"
