#!/usr/bin/env bash
# The test cluster's S3-compatible object store: S3Proxy (a Java S3 server over a directory; `hack/build.sh
# s3proxy` fetches its jar) run on this machine by Java >= 17.
#
#   hack/objectstore.sh start     start it (a no-op when it runs); prints the endpoint and the time to ready
#   hack/objectstore.sh stop      stop it (the data stays)
#   hack/objectstore.sh status    running or not, and one health check with its time
#   hack/objectstore.sh secret [NAME] [NAMESPACE]
#                                 print a Secret manifest (default name kubetrain-s3) for pods:
#                                 AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION
#
# The S3 API answers on 127.0.0.1:PORT and, when the real node exists, on NODE_IP:PORT (10.88.0.1,
# forwarded by socat), so pods use http://10.88.0.1:PORT. Start it after the real node for that
# forward; `start` again adds it (KUBETRAIN_SERVE_NODE_IP=0: loopback only). PORT is
# KUBETRAIN_OBJECTSTORE_PORT (default 8333).
# State under ${KUBETRAIN_CLUSTER_DIR}/objectstore/: buckets/ (a directory per bucket, a file per object),
# s3proxy.log, s3proxy.conf and `credentials` (generated once, mode 600, shell syntax:
# AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...): the only key pair it accepts (AWS signatures v2 and v4).
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=hack/hostsvc.sh
source "${HACK_DIR}/hostsvc.sh"

PORT="${KUBETRAIN_OBJECTSTORE_PORT:-8333}"
S="objectstore"
D="${KUBETRAIN_CLUSTER_DIR}/${S}"
CREDENTIALS="${D}/credentials"
REGION="us-east-1"  # any name works: the gateway checks signatures with the region the client sends

credentials() {  # generated once: the gateway's only identity, so no other key pair is accepted
  [[ -s "$CREDENTIALS" ]] && return 0
  (umask 077 && python3 -c 'import secrets
print(f"AWS_ACCESS_KEY_ID=kubetrain-{secrets.token_hex(6)}")
print(f"AWS_SECRET_ACCESS_KEY={secrets.token_hex(20)}")' >"$CREDENTIALS")
  log "generated ${CREDENTIALS}"
}

properties() {  # s3proxy.conf, mode 600: it holds the secret
  # shellcheck source=/dev/null
  source "$CREDENTIALS"
  (umask 077 && cat >"${D}/s3proxy.conf" <<EOF
s3proxy.endpoint=http://127.0.0.1:${PORT}
s3proxy.authorization=aws-v2-or-v4
s3proxy.identity=${AWS_ACCESS_KEY_ID}
s3proxy.credential=${AWS_SECRET_ACCESS_KEY}
jclouds.provider=filesystem-nio2
jclouds.filesystem.basedir=${D}/buckets
EOF
  )
}

start() {
  local jar started
  jar="$(bin_path s3proxy)"
  [[ -f "$jar" ]] || die "no ${jar}: run hack/build.sh s3proxy"
  command -v java >/dev/null \
    || die "the object store needs Java >= 17 on PATH (Debian: apt-get install openjdk-17-jre-headless)"
  mkdir -p "${D}/buckets"
  credentials
  properties
  if ! svc_alive "$S" s3proxy java; then
    (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null && die "port ${PORT} is in use; set KUBETRAIN_OBJECTSTORE_PORT"
    # shellcheck disable=SC2046  # the options are words
    svc_launch "$S" s3proxy java $(s3proxy_pin java_opts) -jar "$jar" --properties "${D}/s3proxy.conf"
    log "started S3Proxy (pid $(cat "$(svc_pidfile "$S" s3proxy)")), log ${D}/s3proxy.log"
  fi
  started="$(svc_wait 120 "http://127.0.0.1:${PORT}/healthz" "${D}/s3proxy.log")"
  svc_forward "$S" "$PORT"
  log "object store ready in ${started}: http://127.0.0.1:${PORT}$(svc_alive "$S" forward socat \
    && echo " and http://${NODE_IP}:${PORT}") (credentials: ${CREDENTIALS})"
}

stop() {
  svc_kill "$S" forward socat
  svc_kill "$S" s3proxy java
  log "object store stopped (data kept in ${D}/buckets)"
}

status() {
  if ! svc_alive "$S" s3proxy java; then echo "object store: not running"; return 1; fi
  echo "object store: running (pid $(cat "$(svc_pidfile "$S" s3proxy)")), credentials ${CREDENTIALS}"
  echo "  http://127.0.0.1:${PORT}/healthz: $(svc_probe "http://127.0.0.1:${PORT}/healthz")"
  if svc_alive "$S" forward socat; then
    echo "  http://${NODE_IP}:${PORT}/healthz: $(svc_probe "http://${NODE_IP}:${PORT}/healthz")"
  fi
}

secret() {  # secret [NAME] [NAMESPACE]: the manifest on stdout, for `kubectl apply -f -`
  [[ -s "$CREDENTIALS" ]] || die "no ${CREDENTIALS}: run hack/objectstore.sh start first"
  # shellcheck source=/dev/null
  source "$CREDENTIALS"
  cat <<EOF
apiVersion: v1
kind: Secret
metadata:
  name: ${1:-kubetrain-s3}
${2:+  namespace: ${2}
}type: Opaque
stringData:
  AWS_ACCESS_KEY_ID: "${AWS_ACCESS_KEY_ID}"
  AWS_SECRET_ACCESS_KEY: "${AWS_SECRET_ACCESS_KEY}"
  AWS_ENDPOINT_URL: "http://${NODE_IP}:${PORT}"
  AWS_REGION: "${REGION}"
EOF
}

cmd="${1:-}"; shift || true
case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  secret) secret "$@" ;;
  *) die "usage: $0 start | stop | status | secret [NAME] [NAMESPACE]" ;;
esac
