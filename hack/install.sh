#!/usr/bin/env bash
# The chart on the test cluster, with the commands docs/install.md shows (printed as they run).
# The chart's default image names are the ones `make images` loads into the real node, so no
# --set is needed: the operator runs as a real pod and puts the real trainer image into jobs.
#
#   hack/install.sh install      helm install + wait for the operator pod
#   hack/install.sh uninstall    helm uninstall (the CRD stays, as with any Helm install)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

KUBECONFIG="${KUBETRAIN_CLUSTER_DIR}/kubeconfig"
export KUBECONFIG
[[ -f "$KUBECONFIG" ]] || die "no test cluster: make cluster-up first"
PATH="$(dirname "$("${HACK_DIR}/helm/build.sh")"):$(dirname "$(bin_path kubectl)"):${PATH}"
cd "$REPO_ROOT"

run() { printf '+ %s\n' "$*" >&2; "$@"; }

case "${1:-}" in
  install)
    run helm install kubetrain charts/kubetrain --namespace kubetrain-system --create-namespace
    run kubectl -n kubetrain-system rollout status deployment/kubetrain --timeout=180s
    ;;
  uninstall)
    run helm uninstall kubetrain --namespace kubetrain-system --wait
    ;;
  *) die "usage: $0 install | uninstall" ;;
esac
