#!/usr/bin/env bash
# Create or delete kwok fake GPU nodes in the running test cluster.
#
#   hack/nodes.sh create [COUNT]     # nodes <prefix>0 .. <prefix>COUNT-1 (default 4); idempotent
#   hack/nodes.sh delete             # all kwok fake nodes (label type=kwok)
#
# Node shape (environment):
#   KUBETRAIN_NODE_PREFIX  (kwok-gpu-)     name prefix
#   KUBETRAIN_NODE_GPUS    (8)             nvidia.com/gpu
#   KUBETRAIN_NODE_RDMA    (8)             rdma/ib (RDMA devices; 0 leaves it out)
#   KUBETRAIN_NODE_CPU     (96)            cpu
#   KUBETRAIN_NODE_MEMORY  (1Ti)           memory
#   KUBETRAIN_NODE_PODS    (110)           pods
#   KUBETRAIN_NODE_WAIT    (1)             wait until all nodes are Ready
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

PREFIX="${KUBETRAIN_NODE_PREFIX:-kwok-gpu-}"
GPUS="${KUBETRAIN_NODE_GPUS:-8}"
RDMA="${KUBETRAIN_NODE_RDMA:-8}"
CPU="${KUBETRAIN_NODE_CPU:-96}"
MEMORY="${KUBETRAIN_NODE_MEMORY:-1Ti}"
PODS="${KUBETRAIN_NODE_PODS:-110}"
kubectl() { "$(bin_path kubectl)" --kubeconfig "${KUBETRAIN_CLUSTER_DIR}/kubeconfig" "$@"; }

manifest() {  # manifest <count>: a v1 List of Nodes (status is kept by kwok)
  local i res
  res="cpu: \"${CPU}\", memory: \"${MEMORY}\", pods: \"${PODS}\", nvidia.com/gpu: \"${GPUS}\""
  [[ "$RDMA" == 0 ]] || res+=", rdma/ib: \"${RDMA}\""
  printf 'apiVersion: v1\nkind: List\nitems:\n'
  for ((i = 0; i < $1; i++)); do
    printf -- '- apiVersion: v1\n  kind: Node\n  metadata:\n'
    printf '    name: %s%d\n' "$PREFIX" "$i"
    printf '    annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}\n'
    printf '    labels: {type: kwok, kubernetes.io/hostname: %s%d, kubernetes.io/os: linux, kubernetes.io/arch: amd64}\n' "$PREFIX" "$i"
    printf '  status:\n    capacity: {%s}\n    allocatable: {%s}\n' "$res" "$res"
  done
}

case "${1:-}" in
  create)
    count="${2:-4}"
    log "creating ${count} fake nodes ${PREFIX}N: ${GPUS} nvidia.com/gpu, ${RDMA} rdma/ib, ${CPU} cpu, ${MEMORY} memory"
    manifest "$count" | kubectl apply --server-side --field-manager=kubetrain-hack -f - >/dev/null
    if [[ "${KUBETRAIN_NODE_WAIT:-1}" == 1 && "$count" -gt 0 ]]; then
      kubectl wait --for=condition=Ready --timeout=300s -l type=kwok node >/dev/null
      log "${count} fake nodes Ready"
    fi
    ;;
  delete)
    kubectl delete node -l type=kwok --wait=false
    ;;
  manifest)  # for inspection
    manifest "${2:-4}"
    ;;
  *) die "usage: $0 create [COUNT] | delete | manifest [COUNT]" ;;
esac
