#!/usr/bin/env bash
# A throwaway Prometheus server on loopback, from Debian's `prometheus` package.
#
#   hack/prometheus.sh install                 apt-get install prometheus if prometheus/promtool are missing
#   hack/prometheus.sh start DIR CONFIG [PORT] start `prometheus` with CONFIG, data in DIR, on 127.0.0.1:PORT
#                                               (default 19090); prints the pid once /-/ready answers
#   hack/prometheus.sh stop DIR                 stop the server started with that DIR
#
# The pytest fixture in tests/support/prom_server.py calls these. The package's
# own service (systemd unit / init script) is never started: policy-rc.d denies it.
set -euo pipefail

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

install() {
  if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "prometheus is not installed and there is no apt-get (install Prometheus >= 2.42 so that prometheus and promtool are on PATH)"
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  log "installing Debian's prometheus package ..."
  # Keep the package's service from starting: we start our own server per test session.
  local policy=/usr/sbin/policy-rc.d created=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && created=1
  fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2 \
    || { $sudo apt-get update >&2 && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2; }
  [[ $created -eq 0 ]] || $sudo rm -f "$policy"
  command -v prometheus >/dev/null || die "prometheus still not on PATH after install"
}

start() {
  local dir="$1" config="$2" port="${3:-19090}"
  mkdir -p "$dir/data"
  prometheus --config.file="$config" --storage.tsdb.path="$dir/data" \
    --web.listen-address="127.0.0.1:${port}" --web.enable-lifecycle \
    --storage.tsdb.retention.time=1h >"$dir/prometheus.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$dir/prometheus.pid"
  for _ in $(seq 1 150); do
    if curl -fsS "http://127.0.0.1:${port}/-/ready" >/dev/null 2>&1; then
      echo "$pid"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { tail -20 "$dir/prometheus.log" >&2; die "prometheus exited"; }
    sleep 0.2
  done
  tail -20 "$dir/prometheus.log" >&2
  die "prometheus not ready on 127.0.0.1:${port} after 30 s"
}

stop() {
  local dir="$1" pid
  [[ -f "$dir/prometheus.pid" ]] || return 0
  pid="$(cat "$dir/prometheus.pid")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$dir/prometheus.pid"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  install) install ;;
  start) [[ $# -ge 2 ]] || die "usage: $0 start DIR CONFIG [PORT]"; install; start "$@" ;;
  stop) [[ $# -ge 1 ]] || die "usage: $0 stop DIR"; stop "$@" ;;
  *) die "usage: $0 install | start DIR CONFIG [PORT] | stop DIR" ;;
esac
