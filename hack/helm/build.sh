#!/usr/bin/env bash
# Build helm from its Go module (pinned in hack/helm/go.mod) into the same cache
# as the test-cluster binaries:
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/helm-<version>/helm
# A no-op when that directory already holds the binary (i.e. until the pin changes).
#   hack/helm/build.sh           build if missing (hack/build.sh helm: its lock, its progress lines), print the path
#   hack/helm/build.sh --path    only print where the binary is (or would be)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../lib.sh"

out="$(bin_path helm)"
if [[ "${1:-}" != "--path" && ! -x "$out" ]]; then
  "${HACK_DIR}/build.sh" helm >&2
fi
echo "$out"
