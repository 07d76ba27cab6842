#!/usr/bin/env bash
# The test cluster's S3-compatible object store: SeaweedFS's `weed server` (master, volume server,
# filer and S3 gateway in one process; `hack/build.sh seaweedfs` builds it) run on this machine.
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
# KUBETRAIN_OBJECTSTORE_PORT (default 8333); SeaweedFS's internal listeners take the next 7 ports,
# on loopback only.
# State under ${KUBETRAIN_CLUSTER_DIR}/objectstore/: data/, weed.log, s3.json, master.toml and
# `credentials` (generated once, mode 600, shell syntax: AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...).
# Volumes: each bucket is a SeaweedFS collection, which by default grows 7 volumes at its first write; on
# a test machine's disk the automatic volume limit then ran out after a few buckets (PutObject answers
# InternalError). Here a bucket starts with one volume of at most 256 MB, grown as it fills, and the
# server may hold MAX_VOLUMES volumes (files that grow with their data, not preallocated), read-only
# only below 256 MiB free (the default, 1% of the disk, is gigabytes on a CI machine).
# `start` returns when the gateway answers; writes wait about 10 s more, until its filer has joined
# the master's lock ring.
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

MAX_VOLUMES=1000

master_toml() {  # read by `weed server` from its working directory
  printf '[master.volume_growth]\ncopy_1 = 1\nallocation_deferral = "0s"\n' >"${D}/master.toml"
}

identities() {  # s3.json: SeaweedFS accepts ANY key pair when it has none, so it always gets this
  # shellcheck source=/dev/null
  source "$CREDENTIALS"
  (umask 077 && python3 -c 'import json, sys
print(json.dumps({"identities": [{"name": "admin",
    "credentials": [{"accessKey": sys.argv[1], "secretKey": sys.argv[2]}],
    "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))' \
    "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >"${D}/s3.json")
}

start() {
  local weed started
  weed="$(bin_path seaweedfs)"
  [[ -x "$weed" ]] || die "no ${weed}: run hack/build.sh seaweedfs"
  mkdir -p "${D}/data"
  credentials
  identities
  master_toml
  if ! svc_alive "$S" weed weed; then
    (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null && die "port ${PORT} is in use; set KUBETRAIN_OBJECTSTORE_PORT"
    cd "$D"
    svc_launch "$S" weed "$weed" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="${D}/data" \
      -s3 -s3.port="$PORT" -s3.port.grpc=$((PORT + 1)) -s3.config="${D}/s3.json" \
      -master.port=$((PORT + 2)) -master.port.grpc=$((PORT + 3)) \
      -volume.port=$((PORT + 4)) -volume.port.grpc=$((PORT + 5)) \
      -filer -filer.port=$((PORT + 6)) -filer.port.grpc=$((PORT + 7)) \
      -filer.localSocket="${D}/filer.sock" -s3.localSocket="${D}/s3.sock" \
      -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false \
      -master.volumeSizeLimitMB=256 -volume.max="$MAX_VOLUMES" -volume.minFreeSpace=256MiB -volume.preStopSeconds=0
    log "started weed server (pid $(cat "$(svc_pidfile "$S" weed)")), log ${D}/weed.log"
  fi
  started="$(svc_wait 120 "http://127.0.0.1:${PORT}/healthz" "${D}/weed.log")"
  svc_forward "$S" "$PORT"
  log "object store ready in ${started}: http://127.0.0.1:${PORT}$(svc_alive "$S" forward socat \
    && echo " and http://${NODE_IP}:${PORT}") (credentials: ${CREDENTIALS})"
}

stop() {
  svc_kill "$S" forward socat
  svc_kill "$S" weed weed 30  # its filer takes 15 s to give up flushing its change log at shutdown
  log "object store stopped (data kept in ${D}/data)"
}

status() {
  if ! svc_alive "$S" weed weed; then echo "object store: not running"; return 1; fi
  echo "object store: running (pid $(cat "$(svc_pidfile "$S" weed)")), credentials ${CREDENTIALS}"
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
