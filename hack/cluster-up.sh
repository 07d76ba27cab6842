#!/usr/bin/env bash
# Start the local test control plane: etcd, kube-apiserver (RBAC), kube-controller-manager,
# kube-scheduler and the kwok controller, as background processes on loopback,
# then create fake GPU nodes, and start the object store and the image registry (hack/objectstore.sh,
# hack/registry.sh; also when the cluster already runs). Builds missing binaries first (hack/build.sh).
#
#   hack/cluster-up.sh            # idempotent: a healthy running cluster is left alone
#
# Parameters (environment):
#   KUBETRAIN_CACHE        cache root (default ~/.cache/kubetrain)
#   KUBETRAIN_CLUSTER_DIR  state dir (default $KUBETRAIN_CACHE/cluster): pki/, logs/, pids/, kubeconfig
#   KUBETRAIN_APISERVER_PORT (16443)  KUBETRAIN_ETCD_PORT (23790; peer port +10)
#   KUBETRAIN_NODES (4) and the node shape, see hack/nodes.sh
#   KUBETRAIN_REAL_NODE (auto)  1: also run the real node (hack/real-node.sh: kubelet, containerd,
#                          CoreDNS, a volume provisioner); 0: kwok nodes only; auto: 1 where this
#                          machine can (root, containerd, ...), and always under CI=true. The
#                          Debian packages (hack/node-deps.sh) are installed with 1 or under CI only
#   KUBETRAIN_REAL_NODES (2)  how many real nodes (1 to 8): node 1 on this machine's network, the
#                          others each in a network namespace of its own, tainted
#                          kubetrain.io/node-pool=extra:NoSchedule (hack/real-node.sh)
#   KUBETRAIN_AUDIT_POLICY (unset)  an audit policy file: kube-apiserver then writes JSON audit
#                          events to $KUBETRAIN_CLUSTER_DIR/logs/audit.log (bench/compare.py counts requests with it)
#
# Prints the admin kubeconfig path on stdout (last line); logs go to stderr.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

APISERVER_PORT="${KUBETRAIN_APISERVER_PORT:-16443}"
ETCD_PORT="${KUBETRAIN_ETCD_PORT:-23790}"
ETCD_PEER_PORT="$((ETCD_PORT + 10))"
SERVICE_IP="10.96.0.1"
POD_CIDR="10.244.0.0/16"
D="${KUBETRAIN_CLUSTER_DIR}"
PKI="${D}/pki"
KUBECONFIG_ADMIN="${D}/kubeconfig"
SERVER="https://127.0.0.1:${APISERVER_PORT}"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
# The kube-scheduler's own gang scheduling (alpha in v1.36: the scheduling.k8s.io/v1alpha2 PodGroup API and
# the GangScheduling plugin), for TrainingJobs with spec.scheduling.gang: kubernetes. Pods without a
# schedulingGroup are scheduled as before.
FEATURE_GATES="GenericWorkload=true,GangScheduling=true"
REAL_NODE="${KUBETRAIN_REAL_NODE:-auto}"
# Packages are installed where the node is asked for (1) or required (CI); auto only looks.
# (under the lock hack/prebuild.sh takes for them too: two apt-get at once fail on dpkg's lock).
if [[ "$REAL_NODE" == 1 || "${CI:-}" == true ]]; then flock "${KUBETRAIN_CACHE}/.node-deps.lock" "${HACK_DIR}/node-deps.sh"; fi
if [[ "$REAL_NODE" == auto ]]; then
  if why="$("${HACK_DIR}/real-node.sh" check)"; then REAL_NODE=1
  elif [[ "${CI:-}" == true ]]; then die "CI needs the real node, but: ${why}"
  else REAL_NODE=0; log "no real node (${why}); kwok nodes only"
  fi
fi

start_time=$SECONDS

running() {  # running <component>: its pid file names a live process
  local pidfile="${D}/pids/$1.pid"
  [[ -f "$pidfile" ]] && pid_alive "$(cat "$pidfile")"
}

kubectl_admin() { "$(bin_path kubectl)" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

healthy() {
  local c
  for c in "${COMPONENTS[@]}"; do running "$c" || return 1; done
  if [[ "$REAL_NODE" == 1 ]]; then
    local k pidfile
    for ((k = 1; k <= REAL_NODES; k++)); do
      pidfile="${D}/node$(node_suffix "$k")/kubelet.pid"
      [[ -f "$pidfile" ]] && pid_alive "$(cat "$pidfile")" || return 1
    done
  fi
  [[ -f "$KUBECONFIG_ADMIN" ]] && kubectl_admin get --raw=/readyz >/dev/null 2>&1
}

# ---------------------------------------------------------------- certificates
gen_pki() {
  [[ -f "${PKI}/.complete-v2" ]] && return 0
  log "generating certificates in ${PKI}"
  rm -rf "$PKI"; mkdir -p "$PKI"
  (
    cd "$PKI"
    openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
    openssl req -x509 -new -key ca.key -out ca.crt -days 3650 -subj "/CN=kubetrain-test-ca" 2>/dev/null
    # service-account token signing key pair
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    # sign <name> <subject> <extensions>
    sign() {
      openssl ecparam -name prime256v1 -genkey -noout -out "$1.key" 2>/dev/null
      openssl req -new -key "$1.key" -subj "$2" -out "$1.csr" 2>/dev/null
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
        -out "$1.crt" -extfile <(printf '%s\n' "$3") 2>/dev/null
      rm -f "$1.csr"
    }
    local client="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    sign apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:${SERVICE_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    sign admin "/O=system:masters/CN=kubetrain-admin" "$client"
    sign kube-controller-manager "/CN=system:kube-controller-manager" "$client"
    sign kube-scheduler "/CN=system:kube-scheduler" "$client"
    sign kwok "/O=system:masters/CN=kwok-controller" "$client"
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  )
  touch "${PKI}/.complete-v2"
}

write_kubeconfig() {  # write_kubeconfig <file> <cert name> <user>
  local b64="base64 -w0"
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubetrain-test
  cluster:
    server: ${SERVER}
    certificate-authority-data: $($b64 < "${PKI}/ca.crt")
users:
- name: $3
  user:
    client-certificate-data: $($b64 < "${PKI}/$2.crt")
    client-key-data: $($b64 < "${PKI}/$2.key")
contexts:
- name: kubetrain-test
  context: {cluster: kubetrain-test, user: $3}
current-context: kubetrain-test
EOF
  chmod 600 "$1"
}

# ------------------------------------------------------------------- processes
launch() {  # launch <component> <binary> args...
  local name="$1"; shift
  log "starting ${name}"
  # setsid: own process group, so cluster-down can stop it and nothing else. GOGC: the control plane shares
  # two cores with the suite's training and a fifth of the API server's CPU went to Go's collector at the
  # default (100); a larger heap (GOMEMLIMIT bounds it) buys that CPU back.
  GOGC="${KUBETRAIN_CONTROL_PLANE_GOGC:-400}" GOMEMLIMIT="${KUBETRAIN_CONTROL_PLANE_GOMEMLIMIT:-2GiB}" \
    setsid "$@" >"${D}/logs/${name}.log" 2>&1 < /dev/null &
  echo $! > "${D}/pids/${name}.pid"
}

wait_until() {  # wait_until <seconds> <what> <command...>
  local deadline=$((SECONDS + $1)) what="$2"; shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out waiting for ${what}; last log lines:"
      tail -n 20 "${D}"/logs/*.log >&2 || true
      return 1
    fi
    sleep 0.2
  done
}

check_port_free() {
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
    die "port $1 is in use; set KUBETRAIN_APISERVER_PORT / KUBETRAIN_ETCD_PORT"
  fi
}

# ------------------------------------------------------------------------ main
# The object store and the image registry: host processes, started (or found running) with the cluster,
# after the real node so that its pods reach them at NODE_IP.
host_services() {
  "${HACK_DIR}/build.sh" "${HOST_SERVICES[@]}"
  "${HACK_DIR}/objectstore.sh" start
  "${HACK_DIR}/registry.sh" start
}

if healthy; then
  log "cluster already running"
  host_services
  echo "$KUBECONFIG_ADMIN"
  exit 0
fi
# A background build (hack/prebuild.sh) may be building what is needed: build.sh waits for each such part.
prebuild_status="$("${HACK_DIR}/prebuild.sh" status)"
if grep -q '^prebuild: running' <<<"$prebuild_status"; then echo "$prebuild_status" >&2; fi
# Anything half-started is stopped first. That stops the node's containerd: not while hack/images.sh
# loads an image into it (the background build's images, or `make images`).
if [[ -d "${D}/node" && -f "${KUBETRAIN_NODE_RUN}/images.lock" ]]; then
  exec 7>>"${KUBETRAIN_NODE_RUN}/images.lock"
  take_lock 7 "${KUBETRAIN_NODE_RUN}/images.lock" "hack/images.sh to finish (it uses the node's containerd)"
  "${HACK_DIR}/cluster-down.sh" >/dev/null 2>&1 || true
  exec 7>&-
else
  "${HACK_DIR}/cluster-down.sh" >/dev/null 2>&1 || true
fi

if [[ "$REAL_NODE" == 1 ]]; then "${HACK_DIR}/build.sh"; else "${HACK_DIR}/build.sh" "${CONTROL_PLANE[@]}" "${HOST_SERVICES[@]}"; fi
# From here on a failure stops whatever was started (logs stay in ${D}/logs).
trap 'log "cluster-up failed; stopping what was started (logs: ${D}/logs)"; "${HACK_DIR}/cluster-down.sh" >/dev/null 2>&1 || true' ERR
mkdir -p "${D}/logs" "${D}/pids"
rm -rf "${D}/etcd-data" "${D}/kwok"
gen_pki
write_kubeconfig "$KUBECONFIG_ADMIN" admin kubetrain-admin
write_kubeconfig "${D}/kube-controller-manager.kubeconfig" kube-controller-manager system:kube-controller-manager
write_kubeconfig "${D}/kube-scheduler.kubeconfig" kube-scheduler system:kube-scheduler
write_kubeconfig "${D}/kwok.kubeconfig" kwok kwok-controller
check_port_free "$APISERVER_PORT"
audit_args=()
if [[ -n "${KUBETRAIN_AUDIT_POLICY:-}" ]]; then
  [[ -f "${KUBETRAIN_AUDIT_POLICY}" ]] || die "KUBETRAIN_AUDIT_POLICY=${KUBETRAIN_AUDIT_POLICY}: no such file"
  # One file for the whole run: the harness reads it from an offset, and a rotation (100 MB by
  # default; a full bench/compare.py run writes ~250 MB) would lose the run it fell in.
  audit_args=(--audit-policy-file="${KUBETRAIN_AUDIT_POLICY}" --audit-log-path="${D}/logs/audit.log"
              --audit-log-format=json --audit-log-mode=blocking --audit-log-maxsize=100000)
  rm -f "${D}"/logs/audit.log "${D}"/logs/audit-*.log
fi
check_port_free "$ETCD_PORT"
advertise=127.0.0.1
if [[ "$REAL_NODE" == 1 ]]; then
  "${HACK_DIR}/real-node.sh" prepare  # the bridge and credentials the API server points at
  advertise="$NODE_IP"
fi

launch etcd "$(bin_path etcd)" \
  --name=kubetrain --data-dir="${D}/etcd-data" \
  --listen-client-urls="http://127.0.0.1:${ETCD_PORT}" \
  --advertise-client-urls="http://127.0.0.1:${ETCD_PORT}" \
  --listen-peer-urls="http://127.0.0.1:${ETCD_PEER_PORT}" \
  --initial-advertise-peer-urls="http://127.0.0.1:${ETCD_PEER_PORT}" \
  --initial-cluster="kubetrain=http://127.0.0.1:${ETCD_PEER_PORT}" \
  --unsafe-no-fsync --log-level=warn
wait_until 30 etcd curl -fsS "http://127.0.0.1:${ETCD_PORT}/health"

launch kube-apiserver "$(bin_path kube-apiserver)" \
  --etcd-servers="http://127.0.0.1:${ETCD_PORT}" \
  --bind-address=127.0.0.1 --advertise-address="${advertise}" --secure-port="${APISERVER_PORT}" \
  --tls-cert-file="${PKI}/apiserver.crt" --tls-private-key-file="${PKI}/apiserver.key" \
  --client-ca-file="${PKI}/ca.crt" \
  --authorization-mode=Node,RBAC \
  --enable-admission-plugins=NodeRestriction,PodNodeSelector,PodTolerationRestriction \
  --kubelet-preferred-address-types=InternalIP \
  --kubelet-client-certificate="${PKI}/apiserver-kubelet-client.crt" \
  --kubelet-client-key="${PKI}/apiserver-kubelet-client.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="${PKI}/sa.pub" \
  --service-account-signing-key-file="${PKI}/sa.key" \
  --api-audiences=https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range="${SERVICE_CIDR}" \
  --allow-privileged=true --profiling=false --v=1 \
  --feature-gates="${FEATURE_GATES}" --runtime-config=scheduling.k8s.io/v1alpha2=true \
  ${audit_args[@]+"${audit_args[@]}"}
wait_until 90 kube-apiserver kubectl_admin get --raw=/readyz

launch kube-controller-manager "$(bin_path kube-controller-manager)" \
  --kubeconfig="${D}/kube-controller-manager.kubeconfig" \
  --authentication-skip-lookup=true \
  --secure-port=0 --leader-elect=false \
  --controllers='*' \
  --use-service-account-credentials=true \
  --service-account-private-key-file="${PKI}/sa.key" \
  --root-ca-file="${PKI}/ca.crt" \
  --cluster-cidr="${POD_CIDR}" --service-cluster-ip-range="${SERVICE_CIDR}" \
  --concurrent-gc-syncs=5 --v=1

launch kube-scheduler "$(bin_path kube-scheduler)" \
  --kubeconfig="${D}/kube-scheduler.kubeconfig" \
  --authentication-skip-lookup=true \
  --secure-port=0 --leader-elect=false --v=1 --feature-gates="${FEATURE_GATES}"

mkdir -p "${D}/kwok"
kwok_cfg=()
for f in "${HACK_DIR}"/kwok/stages/vendor/*.yaml "${HACK_DIR}"/kwok/stages/*.yaml; do
  # stages/pod-delete.yaml replaces the vendored one (it keeps a lost node's pods Terminating).
  [[ "${f}" == */vendor/pod-delete.yaml ]] && continue
  kwok_cfg+=("--config=${f}")
done
# HOME: kwok keeps its work dir under ~/.kwok; give it ours.
HOME="${D}/kwok" launch kwok "$(bin_path kwok)" \
  "${kwok_cfg[@]}" \
  --kubeconfig="${D}/kwok.kubeconfig" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr="${POD_CIDR}" --node-ip=10.255.0.1 \
  --node-lease-duration-seconds=40

KUBETRAIN_NODE_TAINT="$REAL_NODE" "${HACK_DIR}/nodes.sh" create "${KUBETRAIN_NODES:-4}"

# kube-controller-manager is up once it has created the default ServiceAccount.
wait_until 60 "kube-controller-manager (default ServiceAccount)" \
  kubectl_admin -n default get serviceaccount default
[[ "$REAL_NODE" != 1 ]] || "${HACK_DIR}/real-node.sh" up
for c in "${COMPONENTS[@]}"; do
  running "$c" || { "${HACK_DIR}/cluster-down.sh" >/dev/null 2>&1 || true; die "$c exited; see ${D}/logs/$c.log"; }
done
trap - ERR
host_services

log "cluster up in $((SECONDS - start_time))s: $("$(bin_path kubectl)" version --kubeconfig "$KUBECONFIG_ADMIN" 2>/dev/null | tr '\n' ' ')"
log "export KUBECONFIG=${KUBECONFIG_ADMIN}"
echo "$KUBECONFIG_ADMIN"
