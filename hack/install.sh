#!/usr/bin/env bash
# The chart on the test cluster, with the commands docs/install.md shows (printed as they run): the
# images from the test cluster's registry (`make images` pushes them there, the real node pulls them),
# so the operator runs as a real pod and puts the real trainer image into jobs.
#
#   hack/install.sh install      helm upgrade --install (a second run upgrades) + wait for the operator pod
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
    REGISTRY="$("${HACK_DIR}/images.sh" registry)"
    run helm upgrade --install kubetrain charts/kubetrain --namespace kubetrain-system --create-namespace \
      --set "image.repository=${REGISTRY}/kubetrain-operator" --set "trainerImage=${REGISTRY}/kubetrain-trainer:0.1.0"
    run kubectl -n kubetrain-system rollout status deployment/kubetrain --timeout=180s
    ;;
  uninstall)
    run helm uninstall kubetrain --namespace kubetrain-system --wait
    ;;
  *) die "usage: $0 install | uninstall" ;;
esac
