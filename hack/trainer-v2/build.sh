#!/usr/bin/env bash
# Build Kubeflow Trainer v2's controller manager (cmd/trainer-controller-manager: TrainJob) and the
# JobSet controller it runs on from their Go modules, pinned in hack/trainer-v2/go.mod and
# hack/trainer-v2/jobset/go.mod, into the same cache as the test-cluster binaries:
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/trainer-controller-manager-<version>/trainer-controller-manager
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/jobset-controller-<version>/jobset-controller
# A no-op when the file exists (i.e. until a pin changes). Used by bench/compare.py only.
#
#   hack/trainer-v2/build.sh [--path | --module-dir]            Trainer v2 (its manifests/base/{crds,rbac,
#                                                               manager,webhook,runtimes} are what compare.py applies)
#   hack/trainer-v2/build.sh --jobset [--path | --module-dir]   JobSet (its config/components/{crd,rbac,manager,webhook})
#
# Only the Go module proxy is needed. Neither module has replace directives, so requiring each one
# (a `tool` line) selects exactly the dependency versions of its own go.mod; JobSet's pin is the
# version trainer/v2's go.mod requires. Both upstream images are built with Go 1.26, as here.
# The proxy serves trainer/v2 v2.0.0, v2.0.1, v2.1.0, v2.2.0, v2.2.1, v2.3.0 (checked 2026-11-26;
# v2.3.1, v2.4.x and later answer 403 "not available"), and jobset v0.12.0 but not v0.12.1+.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../lib.sh"

if [[ "${1:-}" == --jobset ]]; then
  shift
  go_tool "${HACK_DIR}/trainer-v2/jobset" sigs.k8s.io/jobset sigs.k8s.io/jobset jobset-controller "$@"
else
  go_tool "${HACK_DIR}/trainer-v2" github.com/kubeflow/trainer/v2 \
    github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager trainer-controller-manager "$@"
fi
