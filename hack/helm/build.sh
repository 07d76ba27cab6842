#!/usr/bin/env bash
# Build helm from its Go module (pinned in hack/helm/go.mod) into the same cache
# as the test-cluster binaries:
#   ${KUBETRAIN_CACHE:-~/.cache/kubetrain}/bin/helm-<version>/helm
# A no-op when that directory already holds the binary (i.e. until the pin changes).
#   hack/helm/build.sh           build if missing, print the binary's path
#   hack/helm/build.sh --path    only print where the binary is (or would be)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/../lib.sh"

MODULE_DIR="${HACK_DIR}/helm"
helm_version() { module_version "${MODULE_DIR}" helm.sh/helm/v4; }
v="$(helm_version)"
out="${KUBETRAIN_BIN_CACHE}/helm-${v}/helm"
if [[ "${1:-}" == "--path" ]]; then
  echo "$out"
  exit 0
fi
if [[ ! -x "$out" ]]; then
  command -v go >/dev/null || die "building helm needs Go >= 1.26 on PATH"
  log "building helm ${v} from helm.sh/helm/v4/cmd/helm (module hack/helm; cold: a few minutes) ..."
  start=$SECONDS
  mkdir -p "$(dirname "$out")"
  ld="-X helm.sh/helm/v4/internal/version.version=${v} -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
  (cd "${MODULE_DIR}" && go build -trimpath -ldflags "-s -w ${ld}" -o "${out}.tmp" helm.sh/helm/v4/cmd/helm)
  mv "${out}.tmp" "$out"
  log "  built ${out} in $((SECONDS - start))s"
fi
echo "$out"
