#!/usr/bin/env bash
# Inject failures into the test cluster: kwok's simulated nodes and pods (the Python twins live in
# tests/support/kwok.py), and the real nodes (hack/real-node.sh), for real.
#
# kwok (labels and annotations selected by the kwok stages in hack/kwok/stages/: kwok's
# pod-container-running-failed and node-not-ready chaos stages, and our kubetrain-pod-succeed stage;
# a pod stage applies once the pod is Running):
#   hack/chaos.sh fail-pod NAMESPACE POD [EXIT_CODE [REASON]]  # Running pod -> Failed with EXIT_CODE (default 1)
#   hack/chaos.sh succeed-pod NAMESPACE POD                    # Running pod -> Succeeded (exit 0)
#   hack/chaos.sh node-not-ready NODE                          # node Ready=False (kcm then taints it)
#   hack/chaos.sh node-ready NODE                              # back to Ready
#
# Real nodes (NODE: kubetrain-node or kubetrain-node-K), each fault undone by its pair:
#   hack/chaos.sh freeze-node NODE | thaw-node NODE     # kubelet, kube-proxy, containerd and its shims
#                                                       # SIGSTOPped, the pods' processes frozen (freezer cgroup)
#   hack/chaos.sh kill-node NODE | restore-node NODE    # the same processes and every pod's killed (SIGKILL);
#                                                       # restore starts the node again (real-node.sh node-up)
#   hack/chaos.sh partition-node NODE | heal-node NODE  # every packet in or out of the node's network
#                                                       # namespace dropped (nodes 2 and up: node 1 is the host's)
#   hack/chaos.sh slow-node NODE [CPUS] | unslow-node NODE  # the node's pods share CPUS (default 0.2) CPUs
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
kubectl() { "$(bin_path kubectl)" --kubeconfig "${KUBETRAIN_CLUSTER_DIR}/kubeconfig" "$@"; }
FAIL=pod-container-running-failed.stage.kwok.x-k8s.io
NOTREADY=node-not-ready.stage.kwok.x-k8s.io

# ------------------------------------------------------------------ real nodes
real_node() {  # real_node <name>: select it (lib.sh node_vars) and its pods' cgroup
  local k
  case "$1" in
    kubetrain-node) k=1 ;;
    kubetrain-node-[2-8]) k="${1##*-}" ;;
    *) die "not a real node: $1 (kubetrain-node or kubetrain-node-K)" ;;
  esac
  ((k <= REAL_NODES)) || die "$1: the cluster has ${REAL_NODES} real nodes (KUBETRAIN_REAL_NODES)"
  NODE_INDEX="$k"
  node_vars "$k"
  STATE="${KUBETRAIN_CLUSTER_DIR}/node$(node_suffix "$k")"
  [[ -f "${STATE}/kubelet.pid" ]] || die "$1 has never run here (no ${STATE}/kubelet.pid)"
  # The kubelet's QoS cgroups (cgroupsPerQOS): every pod of the node lives under them.
  if ((k == 1)); then PODS_CGROUP="/kubepods"; else PODS_CGROUP="/${NODE_NAME}/kubepods"; fi
}

node_daemons() {  # the node's kubelet, kube-proxy, containerd and containerd's shims, one pid a line
  local f
  for f in "${STATE}/kubelet.pid" "${STATE}/kube-proxy.pid" "${NODE_RUN}/containerd.pid"; do
    [[ -f "$f" ]] && pid_alive "$(cat "$f")" && cat "$f"
  done
  pgrep -f "containerd-shim-runc-v2 .*-address ${CONTAINERD_SOCK}" || true
}

cgroup_v2() { [[ -f /sys/fs/cgroup/cgroup.controllers ]]; }

set_frozen() {  # set_frozen 1|0: the node's pods' processes frozen or thawed
  if cgroup_v2; then echo "$1" > "/sys/fs/cgroup${PODS_CGROUP}/cgroup.freeze"
  else
    local f="/sys/fs/cgroup/freezer${PODS_CGROUP}/freezer.state"
    [[ -f "$f" ]] || die "no freezer cgroup ${f}"
    if [[ "$1" == 1 ]]; then echo FROZEN > "$f"; else echo THAWED > "$f"; fi
  fi
}

pod_pids() {  # every process in the node's pods' cgroups
  local dir
  if cgroup_v2; then dir="/sys/fs/cgroup${PODS_CGROUP}"; else dir="/sys/fs/cgroup/freezer${PODS_CGROUP}"; fi
  find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -un
}

freeze_node() {
  set_frozen 1
  # shellcheck disable=SC2046
  kill -STOP $(node_daemons) 2>/dev/null || true
}

thaw_node() {
  # shellcheck disable=SC2046
  kill -CONT $(node_daemons) 2>/dev/null || true
  set_frozen 0
}

# A machine losing power: its daemons and pods die at once and stay dead until restore-node.
# Frozen first, so that nothing forks while it is being killed; SIGKILL reaches frozen tasks once thawed.
kill_node() {
  local daemons pods
  daemons="$(node_daemons)"
  set_frozen 1
  pods="$(pod_pids)"
  # shellcheck disable=SC2086
  kill -KILL $daemons $pods 2>/dev/null || true
  set_frozen 0
}

restore_node() { KUBETRAIN_NODE_INDEX="$NODE_INDEX" "${HACK_DIR}/real-node.sh" node-up; }

partition_node() {
  [[ -n "$NODE_NETNS" ]] || die "${NODE_NAME} shares this machine's network: only nodes 2 and up can be partitioned"
  in_node nft -f - <<EOF
table inet kubetrain_partition
delete table inet kubetrain_partition
table inet kubetrain_partition {
  chain input { type filter hook input priority -300; policy accept; iifname "eth0" drop; }
  chain output { type filter hook output priority -300; policy accept; oifname "eth0" drop; }
  chain forward { type filter hook forward priority -300; policy accept; iifname "eth0" drop; oifname "eth0" drop; }
}
EOF
}

heal_node() {
  [[ -n "$NODE_NETNS" ]] || die "${NODE_NAME} shares this machine's network: nothing to heal"
  in_node nft delete table inet kubetrain_partition 2>/dev/null || true
}

slow_node() {  # slow_node [CPUS]: a CFS quota of CPUS CPUs over all of the node's pods
  local cpus="${1:-0.2}" quota
  quota="$(awk -v c="$cpus" 'BEGIN { q = int(c * 100000); if (q < 1000) exit 1; print q }')" \
    || die "CPUS must be at least 0.01, not ${cpus}"
  if cgroup_v2; then echo "${quota} 100000" > "/sys/fs/cgroup${PODS_CGROUP}/cpu.max"
  else echo 100000 > "/sys/fs/cgroup/cpu${PODS_CGROUP}/cpu.cfs_period_us"
       echo "$quota" > "/sys/fs/cgroup/cpu${PODS_CGROUP}/cpu.cfs_quota_us"; fi
}

unslow_node() {
  if cgroup_v2; then echo "max 100000" > "/sys/fs/cgroup${PODS_CGROUP}/cpu.max"
  else echo -1 > "/sys/fs/cgroup/cpu${PODS_CGROUP}/cpu.cfs_quota_us"; fi
}

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
  freeze-node|thaw-node|kill-node|restore-node|partition-node|heal-node|slow-node|unslow-node)
    [[ $# -ge 2 ]] || die "usage: $0 $1 NODE"
    real_node "$2"
    "${1//-/_}" "${@:3}"
    log "$1 ${NODE_NAME}: done" ;;
  *) die "usage: $0 fail-pod|succeed-pod|node-not-ready|node-ready|freeze-node|thaw-node|kill-node|restore-node|partition-node|heal-node|slow-node|unslow-node ..." ;;
esac
