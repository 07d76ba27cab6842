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

go_tool "${HACK_DIR}/kubeflow" github.com/kubeflow/training-operator github.com/kubeflow/training-operator/cmd/training-operator.v1 training-operator "$@"
