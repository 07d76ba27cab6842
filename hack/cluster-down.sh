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

signal() {  # signal <SIG> <component>: signal its process group; true if it was alive
  local pidfile="${D}/pids/$2.pid" pid
  [[ -f "$pidfile" ]] || return 1
  pid="$(cat "$pidfile")"
  pid_alive "$pid" || return 1
  kill "-$1" -- "-${pid}" 2>/dev/null || kill "-$1" "$pid" 2>/dev/null || true
}

alive() {
  local pidfile="${D}/pids/$1.pid"
  [[ -f "$pidfile" ]] && pid_alive "$(cat "$pidfile")"
}

stop() {  # stop <component>...: TERM them together, KILL what is left after 10 s
  local c i left
  for c in "$@"; do signal TERM "$c" && log "stopping $c (pid $(cat "${D}/pids/$c.pid"))"; done
  for i in $(seq 1 100); do
    left=0
    for c in "$@"; do alive "$c" && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for c in "$@"; do
    signal KILL "$c" && log "killed $c"
    rm -f "${D}/pids/$c.pid"
  done
}

# Clients first (all at once), then the API server, then its storage.
# The real node first, while the API server can still see its pods go.
if [[ -d "${D}/node" ]]; then "${HACK_DIR}/real-node.sh" down || log "real node teardown incomplete; see above"; fi
stop kwok kube-scheduler kube-controller-manager
stop kube-apiserver
stop etcd
"${HACK_DIR}/registry.sh" stop
"${HACK_DIR}/objectstore.sh" stop
rm -rf "${D}/etcd-data"
if [[ "${1:-}" == "--purge" ]]; then
  rm -rf "$D"
  log "removed ${D}"
fi
log "cluster down"
