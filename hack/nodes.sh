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

manifest() {  # manifest <first> <count>: a v1 List of Nodes <first>..<first+count-1> (status is kept by kwok)
  local i res
  res="cpu: \"${CPU}\", memory: \"${MEMORY}\", pods: \"${PODS}\", nvidia.com/gpu: \"${GPUS}\""
  [[ "$RDMA" == 0 ]] || res+=", rdma/ib: \"${RDMA}\""
  printf 'apiVersion: v1\nkind: List\nitems:\n'
  for ((i = $1; i < $1 + $2; i++)); do
    printf -- '- apiVersion: v1\n  kind: Node\n  metadata:\n'
    printf '    name: %s%d\n' "$PREFIX" "$i"
    printf '    annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}\n'
    printf '    labels: {type: kwok, kubernetes.io/hostname: %s%d, kubernetes.io/os: linux, kubernetes.io/arch: amd64}\n' "$PREFIX" "$i"
    # With a real node in the cluster, only pods that tolerate this come here (see docs/testing.md).
    [[ "${TAINT:-0}" == 0 ]] \
      || printf '  spec:\n    taints: [{key: kwok.x-k8s.io/node, value: fake, effect: NoSchedule}]\n'
    printf '  status:\n    capacity: {%s}\n    allocatable: {%s}\n' "$res" "$res"
  done
}

ready_count() {  # fake nodes whose Ready condition is True (one LIST, no per-node GETs)
  kubectl get nodes -l type=kwok --no-headers \
    -o 'custom-columns=R:.status.conditions[?(@.type=="Ready")].status' | grep -c '^True$' || true
}

case "${1:-}" in
  create)
    # Tainted whenever the cluster has a real node (cluster-up says so; a later create looks).
    TAINT="${KUBETRAIN_NODE_TAINT:-}"
    if [[ -z "${TAINT}" ]]; then
      if kubectl get node -l kubetrain.io/node=real -o name 2>/dev/null | grep -q .; then TAINT=1; else TAINT=0; fi
    fi
    count="${2:-4}" chunk=100 start=$SECONDS
    log "creating ${count} fake nodes ${PREFIX}N: ${GPUS} nvidia.com/gpu, ${RDMA} rdma/ib, ${CPU} cpu, ${MEMORY} memory"
    # kubectl sends one request per object: apply chunks of 100 in parallel.
    pids=()
    for ((first = 0; first < count; first += chunk)); do
      n=$((count - first < chunk ? count - first : chunk))
      manifest "$first" "$n" | kubectl apply --server-side --field-manager=kubetrain-hack -f - >/dev/null &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    if [[ "${KUBETRAIN_NODE_WAIT:-1}" == 1 && "$count" -gt 0 ]]; then
      deadline=$((SECONDS + 600))
      until [[ "$(ready_count)" -ge "$count" ]]; do
        ((SECONDS < deadline)) || die "fake nodes not Ready after 600 s ($(ready_count)/${count})"
        sleep 0.5
      done
      log "${count} fake nodes Ready in $((SECONDS - start))s"
    fi
    ;;
  delete)
    # One delete-collection request instead of one DELETE per node. Then wait until
    # the garbage collector has removed their Leases: kwok loses track of a node
    # re-created under the same name while its old Lease is still being collected.
    names="$(kubectl get nodes -l type=kwok -o name | sed 's#^node/##')"
    kubectl delete --raw '/api/v1/nodes?labelSelector=type%3Dkwok' >/dev/null
    deadline=$((SECONDS + 120))
    while [[ -n "$names" ]] && kubectl -n kube-node-lease get lease -o name | sed 's#^lease.coordination.k8s.io/##' \
        | grep -qxF -f <(printf '%s\n' "$names"); do
      ((SECONDS < deadline)) || die "Leases of deleted fake nodes still present after 120 s"
      sleep 0.5
    done
    log "deleted all fake nodes"
    ;;
  manifest)  # for inspection
    manifest 0 "${2:-4}"
    ;;
  *) die "usage: $0 create [COUNT] | delete | manifest [COUNT]" ;;
esac
