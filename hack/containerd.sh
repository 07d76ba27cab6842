#!/usr/bin/env bash
# A real node's container runtime: Debian's containerd (1.6) with runc, its own
# root and socket (see lib.sh), so it never touches a system containerd. One per real node:
# KUBETRAIN_NODE_INDEX=k picks node k's, which runs in that node's network namespace (its pods'
# networks are made by the CNI plugins it runs, in its own namespace).
#
#   hack/containerd.sh start    idempotent; prints the socket path
#   hack/containerd.sh stop
#
# CRI settings that this machine needs:
# - restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE, and runc fails every
#   sandbox writing oom_score_adj below the parent's without it;
# - cgroupfs (no systemd here), cgroup v1 tolerated by the kubelet config;
# - the sandbox (pause) image is ours, built from hack/pause and imported at start;
# - no registry: every pull goes to a closed loopback port (see write_config).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

CONF="${NODE_RUN}/containerd.toml"
LOGF="${NODE_ROOT}/logs/containerd.log"
PIDF="${NODE_RUN}/containerd.pid"
CNI_CONF_DIR="${NODE_RUN}/cni/net.d"
REGISTRY_CONF="${KUBETRAIN_NODE_RUN}/registry"  # one for all nodes: hack/registry.sh adds its host there

write_config() {
  mkdir -p "$(dirname "$CONF")" "${NODE_ROOT}/logs" "$CNI_CONF_DIR" "${REGISTRY_CONF}/_default"
  # No registry is reachable from here, and a pull must not even resolve a registry's name through
  # the machine's resolver: every registry host is served by a loopback port nothing listens on,
  # so a missing image fails at once with "connection refused" (ErrImagePull), locally.
  cat > "${REGISTRY_CONF}/_default/hosts.toml" <<TOML
server = "http://127.0.0.1:1"
[host."http://127.0.0.1:1"]
  capabilities = ["pull", "resolve"]
TOML
  cat > "$CONF" <<TOML
version = 2
root = "${NODE_ROOT}/containerd"
state = "${NODE_RUN}/containerd"
[grpc]
  address = "${CONTAINERD_SOCK}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "${PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "${REGISTRY_CONF}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "${CNI_CONF_DIR}"
[plugins."io.containerd.internal.v1.opt"]
  path = "${NODE_ROOT}/opt"
TOML
}

running() { [[ -f "$PIDF" ]] && pid_alive "$(cat "$PIDF")" && [[ -S "$CONTAINERD_SOCK" ]]; }

case "${1:-}" in
  start)
    command -v containerd >/dev/null || die "containerd not installed (hack/node-deps.sh installs it)"
    if ! running; then
      write_config
      log "starting containerd (socket ${CONTAINERD_SOCK})"
      ${NODE_EXEC[@]+"${NODE_EXEC[@]}"} setsid containerd --config "$CONF" >>"$LOGF" 2>&1 < /dev/null &
      echo $! > "$PIDF"
      for _ in $(seq 100); do ctr_node version >/dev/null 2>&1 && break; sleep 0.1; done
      ctr_node version >/dev/null 2>&1 || { tail -n 20 "$LOGF" >&2; die "containerd did not start"; }
    fi
    echo "$CONTAINERD_SOCK"
    ;;
  stop)
    if running; then
      kill "$(cat "$PIDF")" 2>/dev/null || true
      for _ in $(seq 50); do pid_alive "$(cat "$PIDF")" || break; sleep 0.1; done
    fi
    rm -f "$PIDF"
    ;;
  *) die "usage: $0 start | stop" ;;
esac
