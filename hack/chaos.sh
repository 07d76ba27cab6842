#!/usr/bin/env bash
# Inject failures into the kwok-simulated cluster (test helpers; the Python twins
# live in tests/support/kwok.py).
#
#   hack/chaos.sh fail-pod NAMESPACE POD [EXIT_CODE [REASON]]  # Running pod -> Failed with EXIT_CODE (default 1)
#   hack/chaos.sh succeed-pod NAMESPACE POD                    # Running pod -> Succeeded (exit 0)
#   hack/chaos.sh node-not-ready NODE                          # node Ready=False (kcm then taints it)
#   hack/chaos.sh node-ready NODE                              # back to Ready
#
# Mechanism: labels/annotations selected by the kwok stages in hack/kwok/stages/
# (kwok's pod-container-running-failed and node-not-ready chaos stages, and our
# kubetrain-pod-succeed stage). A pod stage applies once the pod is Running.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
kubectl() { "$(bin_path kubectl)" --kubeconfig "${KUBETRAIN_CLUSTER_DIR}/kubeconfig" "$@"; }
FAIL=pod-container-running-failed.stage.kwok.x-k8s.io
NOTREADY=node-not-ready.stage.kwok.x-k8s.io

case "${1:-}" in
  fail-pod)
    [[ $# -ge 3 ]] || die "usage: $0 fail-pod NAMESPACE POD [EXIT_CODE [REASON]]"
    patch="$(printf '{"metadata": {"annotations": {"%s/exit-code": "%s", "%s/reason": "%s", "%s/delay": "0s", "%s/jitter-delay": "0s"}, "labels": {"%s": "true"}}}' \
      "$FAIL" "${4:-1}" "$FAIL" "${5:-Error}" "$FAIL" "$FAIL" "$FAIL")"
    kubectl -n "$2" patch pod "$3" --type=merge -p "$patch" ;;
  succeed-pod)
    [[ $# -ge 3 ]] || die "usage: $0 succeed-pod NAMESPACE POD"
    kubectl -n "$2" label pod "$3" --overwrite kwok.kubetrain.io/succeed=true ;;
  node-not-ready)
    [[ $# -ge 2 ]] || die "usage: $0 node-not-ready NODE"
    kubectl annotate node "$2" --overwrite "${NOTREADY}/delay=0s" "${NOTREADY}/jitter-delay=0s" >/dev/null
    kubectl label node "$2" --overwrite "${NOTREADY}=true" ;;
  node-ready)
    [[ $# -ge 2 ]] || die "usage: $0 node-ready NODE"
    kubectl label node "$2" "${NOTREADY}-" ;;
  *) die "usage: $0 fail-pod|succeed-pod|node-not-ready|node-ready ..." ;;
esac
