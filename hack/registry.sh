#!/usr/bin/env bash
# The test cluster's image registry: CNCF Distribution's `registry` (`hack/build.sh registry` builds
# it) run on this machine, plain HTTP and no authentication, so it listens only on 127.0.0.1 and,
# when the real node exists, on NODE_IP (10.88.0.1, forwarded by socat) for the node and its pods.
#
#   hack/registry.sh start     start it (a no-op when it runs); prints the address and the time to ready
#   hack/registry.sh stop      stop it (the images stay)
#   hack/registry.sh status    running or not, and one health check (GET /v2/) with its time
#
# PORT is KUBETRAIN_REGISTRY_PORT (default 5000). Start it after the real node for the NODE_IP
# forward; `start` again adds it (KUBETRAIN_SERVE_NODE_IP=0: loopback only). With the forward, the real
# node's containerd pulls images named NODE_IP:PORT/... from here (plain HTTP, a hosts.toml of its own);
# every other registry stays unreachable for it.
# State under ${KUBETRAIN_CLUSTER_DIR}/registry/: storage/ (the images), config.yml, registry.log.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=hack/hostsvc.sh
source "${HACK_DIR}/hostsvc.sh"

PORT="${KUBETRAIN_REGISTRY_PORT:-5000}"
S="registry"
D="${KUBETRAIN_CLUSTER_DIR}/${S}"

config() {  # deletes allowed, so tests can clean up what they push
  cat >"${D}/config.yml" <<EOF
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: ${D}/storage
  delete:
    enabled: true
http:
  addr: 127.0.0.1:${PORT}
  headers:
    X-Content-Type-Options: [nosniff]
EOF
}

node_pulls_here() {  # the real node's containerd (hack/containerd.sh: config_path) pulls ${NODE_IP}:PORT/... here
  local dir="${KUBETRAIN_NODE_RUN}/registry/${NODE_IP}:${PORT}"
  mkdir -p "$dir"
  cat >"${dir}/hosts.toml" <<TOML
server = "http://${NODE_IP}:${PORT}"
[host."http://${NODE_IP}:${PORT}"]
  capabilities = ["pull", "resolve"]
TOML
}

# Each push of a rebuilt image leaves the old manifest untagged and its layers behind (GBs for the
# trainer): drop them while the registry is stopped, as Distribution requires (well under a second).
collect_garbage() {
  local before after
  # A registry that never stored an image has nothing to collect (and its collector fails on that).
  [[ -d "${D}/storage/docker/registry/v2/repositories" ]] || return 0
  before="$(du -sm "${D}/storage" | cut -f1)"
  "$1" garbage-collect --delete-untagged "${D}/config.yml" >"${D}/gc.log" 2>&1 \
    || { log "registry garbage-collect failed (kept going), log ${D}/gc.log"; return 0; }
  after="$(du -sm "${D}/storage" | cut -f1)"
  if (( before > after )); then log "registry: freed $((before - after)) MiB of untagged images"; fi
}

start() {
  local registry started
  registry="$(bin_path registry)"
  [[ -x "$registry" ]] || die "no ${registry}: run hack/build.sh registry"
  mkdir -p "${D}/storage"
  if ! svc_alive "$S" registry registry; then
    (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null && die "port ${PORT} is in use; set KUBETRAIN_REGISTRY_PORT"
    config
    collect_garbage "$registry"
    svc_launch "$S" registry "$registry" serve "${D}/config.yml"
    log "started registry (pid $(cat "$(svc_pidfile "$S" registry)")), log ${D}/registry.log"
  fi
  started="$(svc_wait 60 "http://127.0.0.1:${PORT}/v2/" "${D}/registry.log")"
  svc_forward "$S" "$PORT"
  if svc_alive "$S" forward socat; then node_pulls_here; fi
  log "registry ready in ${started}: 127.0.0.1:${PORT}$(svc_alive "$S" forward socat && echo " and ${NODE_IP}:${PORT}")"
}

stop() {
  svc_kill "$S" forward socat
  svc_kill "$S" registry registry
  log "registry stopped (images kept in ${D}/storage)"
}

status() {
  if ! svc_alive "$S" registry registry; then echo "registry: not running"; return 1; fi
  echo "registry: running (pid $(cat "$(svc_pidfile "$S" registry)"))"
  echo "  http://127.0.0.1:${PORT}/v2/: $(svc_probe "http://127.0.0.1:${PORT}/v2/")"
  if svc_alive "$S" forward socat; then
    echo "  http://${NODE_IP}:${PORT}/v2/: $(svc_probe "http://${NODE_IP}:${PORT}/v2/")"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 start | stop | status" ;;
esac
