#!/usr/bin/env bash
# Build Kueue's controller manager (cmd/kueue) from its Go module, pinned in hack/kueue/go.mod, into
# the same cache as the test-cluster binaries:
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/kueue-<version>/kueue
# A no-op when that file exists (i.e. until the pin changes). Used by tests/support/kueue.py.
#
#   hack/kueue/build.sh                 build if missing, print the binary's path
#   hack/kueue/build.sh --path          only print where the binary is (or would be)
#   hack/kueue/build.sh --module-dir    print the module's directory in GOMODCACHE (downloads it if
#                                       needed): its config/components/{crd/bases,webhook} are what the tests apply
#
# Only the Go module proxy is needed. The module has no replace directives, so requiring it (a `tool`
# line) selects exactly the dependency versions of its own go.mod. v0.15.2 is the newest release the
# proxy serves here (v0.16 and v0.15.3+ are refused).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../lib.sh"

go_tool "${HACK_DIR}/kueue" sigs.k8s.io/kueue sigs.k8s.io/kueue/cmd/kueue kueue "$@"
