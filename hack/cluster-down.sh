#!/usr/bin/env bash
# Stop the local test control plane started by hack/cluster-up.sh and drop its
# etcd data (the next cluster-up starts from an empty cluster). Certificates
# and built binaries are kept, so the next start is fast.
#
#   hack/cluster-down.sh [--purge]   # --purge also removes the whole state dir
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
D="${KUBETRAIN_CLUSTER_DIR}"

stop() {  # stop <component>: TERM its process group, KILL after 10 s
  local pidfile="${D}/pids/$1.pid" pid i
  [[ -f "$pidfile" ]] || return 0
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping $1 (pid ${pid})"
    kill -TERM -- "-${pid}" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-${pid}" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
}

for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$c"; done
rm -rf "${D}/etcd-data"
if [[ "${1:-}" == "--purge" ]]; then
  rm -rf "$D"
  log "removed ${D}"
fi
log "cluster down"
