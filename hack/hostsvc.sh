# shellcheck shell=bash
# Host services of the test cluster (hack/objectstore.sh, hack/registry.sh): one process on this
# machine, listening on loopback, plus a socat forward from NODE_IP so that pods on the real node's
# bridge reach it too. Nothing listens on any other address. Source it after lib.sh; do not run it.
#
# Each service keeps its pid files in ${KUBETRAIN_CLUSTER_DIR}/<name>/.

svc_pidfile() { echo "${KUBETRAIN_CLUSTER_DIR}/$1/$2.pid"; }  # svc_pidfile <service> <process>

# svc_alive <service> <process> <binary>: its pid file names a live process of that binary (a pid file
# can outlive its process, and the pid be reused).
svc_alive() {
  local f pid
  f="$(svc_pidfile "$1" "$2")"
  [[ -f "$f" ]] || return 1
  pid="$(cat "$f")"
  pid_alive "$pid" && [[ "$(basename "$(readlink "/proc/${pid}/exe" 2>/dev/null)")" == "$3" ]]
}

# svc_launch <service> <process> <command...>: setsid'd (own process group), log next to the pid file.
svc_launch() {
  local s="$1" p="$2"; shift 2
  setsid "$@" >"${KUBETRAIN_CLUSTER_DIR}/${s}/${p}.log" 2>&1 </dev/null &
  echo $! >"$(svc_pidfile "$s" "$p")"
}

# svc_kill <service> <process> <binary> [grace s]: TERM its process group, KILL it after grace (10) s.
svc_kill() {
  local f pid
  f="$(svc_pidfile "$1" "$2")"
  svc_alive "$1" "$2" "$3" || { rm -f "$f"; return 0; }
  pid="$(cat "$f")"
  kill -- "-${pid}" 2>/dev/null || kill "$pid" 2>/dev/null || true
  for _ in $(seq $((${4:-10} * 10))); do pid_alive "$pid" || break; sleep 0.1; done
  pid_alive "$pid" && kill -9 -- "-${pid}" 2>/dev/null
  rm -f "$f"
}

# node_ip_up: the real node's bridge carries NODE_IP (hack/real-node.sh made it).
node_ip_up() { ip -o -4 addr show dev "$NODE_BRIDGE" 2>/dev/null | grep -q " ${NODE_IP}/"; }

# svc_forward <service> <port>: NODE_IP:<port> -> 127.0.0.1:<port> while the bridge exists; a no-op
# without the real node, when the forward already runs, or with KUBETRAIN_SERVE_NODE_IP=0 (loopback only).
svc_forward() {
  [[ "${KUBETRAIN_SERVE_NODE_IP:-1}" != 0 ]] || { log "$1: loopback only (KUBETRAIN_SERVE_NODE_IP=0)"; return 0; }
  node_ip_up || { log "$1: no real node (${NODE_BRIDGE} has no ${NODE_IP}): loopback only"; return 0; }
  svc_alive "$1" forward socat && return 0
  command -v socat >/dev/null || die "$1: socat is needed to serve pods at ${NODE_IP}:$2"
  svc_launch "$1" forward socat "TCP-LISTEN:$2,bind=${NODE_IP},fork,reuseaddr" "TCP:127.0.0.1:$2"
  for _ in $(seq 20); do svc_alive "$1" forward socat && return 0; sleep 0.1; done  # setsid execs socat
  die "$1: the forward from ${NODE_IP}:$2 did not start; see ${KUBETRAIN_CLUSTER_DIR}/$1/forward.log"
}

# svc_wait <seconds> <url> <log>: until <url> answers 2xx; prints how long it took.
svc_wait() {
  local deadline=$((SECONDS + $1)) start=$EPOCHREALTIME
  until curl -fsS -o /dev/null --max-time 2 "$2" 2>/dev/null; do
    if ((SECONDS >= deadline)); then tail -n 20 "$3" >&2; die "no answer from $2 after $1 s"; fi
    sleep 0.2
  done
  python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}s')" "$start" "$EPOCHREALTIME"
}

# svc_probe <url>: "HTTP <code> in <seconds>s" for one GET (code 000: no answer).
svc_probe() {
  curl -s -o /dev/null --max-time 5 -w 'HTTP %{http_code} in %{time_total}s' "$1" 2>/dev/null || true
}
