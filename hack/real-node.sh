#!/usr/bin/env bash
# The test cluster's real node: kubelet, kube-proxy, containerd + runc and the CNI
# bridge on this machine, with CoreDNS and a dynamic volume provisioner
# (local-path-provisioner) beside it. Pods run for real here; kwok's nodes only pretend.
#
#   hack/real-node.sh prepare    bridge, firewall, credentials (before kube-apiserver, which
#                                advertises NODE_IP)
#   hack/real-node.sh up         everything else; waits until the node is Ready
#   hack/real-node.sh down       stops it all, removes pods' sandboxes, the bridge and the firewall,
#                                and restores the host settings it changed
#   hack/real-node.sh check      exits 0 when this machine can run the node, else says why
#
# Containment: pods live on the bridge NODE_BRIDGE (NODE_POD_CIDR) with no NAT and no route
# out; an nftables rule drops anything a pod sends beyond the pod range. DNS is CoreDNS
# without a forward plugin, so no name is resolved outside the cluster. The API server is
# reached from pods through the `kubernetes` Service (advertised at NODE_IP, forwarded to
# its loopback listener). Needs root, Linux with cgroups, nftables and overlayfs.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

D="${KUBETRAIN_CLUSTER_DIR}"
N="${D}/node"                        # this node's config, certificates, pid files
PKI="${D}/pki"
NODE_NAME="${KUBETRAIN_REAL_NODE_NAME:-kubetrain-node}"
APISERVER_PORT="${KUBETRAIN_APISERVER_PORT:-16443}"
KUBELET_ROOT="${KUBETRAIN_NODE_ROOT}/kubelet"
VOLUMES="${KUBETRAIN_NODE_ROOT}/volumes"
NFT_TABLE="kubetrain_node"
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables vm.overcommit_memory kernel.panic kernel.panic_on_oops)
HELPER_IMAGE="docker.io/kubetrain/volume-helper:1.0"
PROCS=(kubelet kube-proxy coredns local-path-provisioner apiserver-forward)

kubectl_admin() { "$(bin_path kubectl)" --kubeconfig "${D}/kubeconfig" "$@"; }

check() {
  local missing=() c
  [[ "$(id -u)" == 0 ]] || { echo "the real node needs root"; return 1; }
  for c in containerd runc nft ip socat conntrack; do command -v "$c" >/dev/null || missing+=("$c"); done
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  [[ ${#missing[@]} -eq 0 ]] || { echo "missing: ${missing[*]} (hack/node-deps.sh installs them)"; return 1; }
  grep -qw overlay /proc/filesystems || { echo "no overlayfs in this kernel"; return 1; }
  # One machine, one real node: another cluster's kubelet may hold the bridge and ports.
  if ! { [[ -f "${N}/kubelet.pid" ]] && pid_alive "$(cat "${N}/kubelet.pid")"; } \
      && (exec 3<>"/dev/tcp/127.0.0.1/10248") 2>/dev/null; then
    echo "another cluster's real node runs on this machine (kubelet on 127.0.0.1:10248)"; return 1
  fi
}

# ---------------------------------------------------------------- network
net_up() {
  mkdir -p "$N"
  if [[ ! -f "${N}/sysctl.saved" ]]; then  # the host's values, restored by down
    for s in "${SYSCTLS[@]}"; do printf '%s=%s\n' "$s" "$(sysctl -n "$s" 2>/dev/null || echo)"; done > "${N}/sysctl.saved"
  fi
  ip link show "$NODE_BRIDGE" >/dev/null 2>&1 || ip link add "$NODE_BRIDGE" type bridge
  # A bridge whose address was never set takes the lowest of its ports' (the pods' veths): when that pod
  # goes, the node's address moves to another MAC and every other pod's ARP entry for NODE_IP is stale
  # until it expires (30-60 s). Their DNS queries to CoreDNS here timed out that long after each pod
  # deletion or eviction. A fixed, locally administered address stays.
  ip link set "$NODE_BRIDGE" address "$NODE_BRIDGE_MAC"
  ip addr replace "${NODE_IP}/16" dev "$NODE_BRIDGE"
  ip link set "$NODE_BRIDGE" up
  # Service traffic between two pods on one bridge must pass the host's nftables.
  sysctl -qw net.bridge.bridge-nf-call-iptables=1
  nft -f - <<EOF
table ip ${NFT_TABLE}
delete table ip ${NFT_TABLE}
table ip ${NFT_TABLE} {
  counter escaped {}
  chain forward {
    type filter hook forward priority -10; policy accept;
    ip saddr ${NODE_POD_CIDR} ip daddr != ${NODE_POD_CIDR} counter name escaped drop
    ip daddr ${NODE_POD_CIDR} ip saddr != ${NODE_POD_CIDR} drop
  }
}
EOF
}

# The kubelet's own iptables chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...): the jumps to them
# first, then the chains. Only KUBE-* chains: nothing else of the host's rules is touched.
kubelet_chains_down() {
  local cmd t c rule
  for cmd in iptables ip6tables; do
    command -v "$cmd" >/dev/null || continue
    for t in filter nat mangle; do
      local chains=()
      mapfile -t chains < <("$cmd" -t "$t" -S 2>/dev/null | awk '/^-N KUBE-/{print $2}')
      [[ ${#chains[@]} -gt 0 ]] || continue
      for c in "${chains[@]}"; do
        "$cmd" -t "$t" -S 2>/dev/null | grep -E -- "-j ${c}( |$)" | sed 's/^-A /-D /' \
          | while read -r rule; do eval "$cmd -t $t $rule" 2>/dev/null || true; done || true
      done
      for c in "${chains[@]}"; do "$cmd" -t "$t" -F "$c" 2>/dev/null || true; done
      for c in "${chains[@]}"; do "$cmd" -t "$t" -X "$c" 2>/dev/null || true; done
    done
  done
}

net_down() {
  local t
  for t in "ip ${NFT_TABLE}" "ip kube-proxy" "ip6 kube-proxy"; do nft delete table $t 2>/dev/null || true; done
  kubelet_chains_down
  ip link del "$NODE_BRIDGE" 2>/dev/null || true
  if [[ -f "${N}/sysctl.saved" ]]; then
    while IFS='=' read -r k v; do [[ -z "$v" ]] || sysctl -qw "$k=$v" 2>/dev/null || true; done < "${N}/sysctl.saved"
    rm -f "${N}/sysctl.saved"
  fi
}

# ------------------------------------------------------------ credentials
node_pki() {  # client certificates for the node's components, signed by the cluster CA
  [[ -f "${PKI}/node/.complete" ]] && return 0
  mkdir -p "${PKI}/node"
  local name subj
  for pair in "kubelet:/O=system:nodes/CN=system:node:${NODE_NAME}" "kube-proxy:/CN=system:kube-proxy" \
              "coredns:/O=system:masters/CN=kubetrain-coredns" "local-path:/O=system:masters/CN=kubetrain-local-path"; do
    name="${pair%%:*}" subj="${pair#*:}"
    openssl ecparam -name prime256v1 -genkey -noout -out "${PKI}/node/${name}.key" 2>/dev/null
    openssl req -new -key "${PKI}/node/${name}.key" -subj "$subj" 2>/dev/null \
      | openssl x509 -req -CA "${PKI}/ca.crt" -CAkey "${PKI}/ca.key" -CAcreateserial -days 3650 \
          -out "${PKI}/node/${name}.crt" \
          -extfile <(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n') 2>/dev/null
  done
  touch "${PKI}/node/.complete"
}

kubeconfig() {  # kubeconfig <name>: a kubeconfig for PKI/node/<name>.crt on loopback
  local b64="base64 -w0"
  cat > "${N}/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubetrain-test
  cluster: {server: "https://127.0.0.1:${APISERVER_PORT}", certificate-authority-data: $($b64 < "${PKI}/ca.crt")}
users:
- name: $1
  user: {client-certificate-data: $($b64 < "${PKI}/node/$1.crt"), client-key-data: $($b64 < "${PKI}/node/$1.key")}
contexts:
- name: kubetrain-test
  context: {cluster: kubetrain-test, user: $1}
current-context: kubetrain-test
EOF
  chmod 600 "${N}/$1.kubeconfig"
}

# ------------------------------------------------------------- processes
start() {  # start <name> <command...>: a setsid'd background process with a pid file
  local name="$1"; shift
  setsid "$@" >"${D}/logs/${name}.log" 2>&1 < /dev/null &
  echo $! > "${N}/${name}.pid"
}

stop_procs() {
  local p pid
  for p in "${PROCS[@]}"; do
    [[ -f "${N}/${p}.pid" ]] || continue
    pid="$(cat "${N}/${p}.pid")"
    rm -f "${N}/${p}.pid"
    # A pid file can outlive its process (a crash, a reboot): signal only the program we started.
    pid_alive "$pid" && [[ "$(basename "$(readlink "/proc/${pid}/exe" 2>/dev/null)")" == "$(proc_binary "$p")" ]] \
      || continue
    kill -- "-${pid}" 2>/dev/null || kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && kill -9 -- "-${pid}" 2>/dev/null || true
  done
}

proc_binary() { if [[ "$1" == apiserver-forward ]]; then echo socat; else echo "$1"; fi; }

# ----------------------------------------------------------------- images
import_small_images() {  # the pod sandbox and the volume helper: built here, no registry
  local tmp
  tmp="$(mktemp -d)"
  if ! ctr_node images ls -q | grep -xF "$PAUSE_IMAGE" >/dev/null; then
    python3 "${HACK_DIR}/oci-image.py" "${tmp}/pause.tar" "$PAUSE_IMAGE" --entrypoint /pause "/pause=$(bin_path pause)"
    ctr_node images import --base-name "${PAUSE_IMAGE%:*}" "${tmp}/pause.tar" >/dev/null
  fi
  if ! ctr_node images ls -q | grep -xF "$HELPER_IMAGE" >/dev/null; then
    (cd "$tmp" && apt-get download -qq busybox-static >/dev/null && dpkg -x busybox-static_*.deb bb)
    local links=() a
    for a in sh mkdir rm rmdir chmod ls cat test; do links+=("/bin/${a}@busybox"); done
    python3 "${HACK_DIR}/oci-image.py" "${tmp}/helper.tar" "$HELPER_IMAGE" --entrypoint /bin/sh \
      "/bin/busybox=${tmp}/bb/bin/busybox" "${links[@]}"
    ctr_node images import --base-name "${HELPER_IMAGE%:*}" "${tmp}/helper.tar" >/dev/null
  fi
  rm -rf "$tmp"
}

# ----------------------------------------------------------------- kubelet
kubelet_up() {
  : > "${N}/resolv.conf"  # pods get CoreDNS only; nothing of the host's resolver
  cat > "${N}/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: ${NODE_IP}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "${PKI}/ca.crt"}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://${CONTAINERD_SOCK}
clusterDNS: [${NODE_IP}]
clusterDomain: cluster.local
resolvConf: ${N}/resolv.conf
registerNode: true
nodeStatusUpdateFrequency: 4s
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "200Mi", nodefs.available: "1%", imagefs.available: "1%"}
maxPods: 50
EOF
  mkdir -p "$KUBELET_ROOT"
  start kubelet "$(bin_path kubelet)" --config="${N}/kubelet.yaml" --kubeconfig="${N}/kubelet.kubeconfig" \
    --root-dir="$KUBELET_ROOT" --cert-dir="${N}/kubelet-pki" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
    --node-labels="kubetrain.io/node=real" \
    --v=1
}

kube_proxy_up() {
  cat > "${N}/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: "${N}/kube-proxy.kubeconfig"}
hostnameOverride: ${NODE_NAME}
clusterCIDR: ${NODE_POD_CIDR}
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0}
EOF
  start kube-proxy "$(bin_path kube-proxy)" --config="${N}/kube-proxy.yaml" --v=1
}

# --------------------------------------------------------------------- CNI
# Pods get the pod range on the bridge and one route: the Service range via the node.
# No default route, so any other address is unreachable from a pod (and dropped if tried).
cni_config() {
  mkdir -p "${KUBETRAIN_NODE_RUN}/cni/net.d"
  cat > "${KUBETRAIN_NODE_RUN}/cni/net.d/10-kubetrain.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "kubetrain", "plugins": [
  {"type": "bridge", "bridge": "${NODE_BRIDGE}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "${NODE_POD_CIDR}", "rangeStart": "10.88.1.1", "gateway": "${NODE_IP}"}]],
            "routes": [{"dst": "${SERVICE_CIDR}", "gw": "${NODE_IP}"}],
            "dataDir": "${KUBETRAIN_NODE_RUN}/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}},
  {"type": "loopback"}
]}
EOF
}

coredns_up() {
  cat > "${N}/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 {
  bind ${NODE_IP}
  errors
  cache 5
  kubernetes cluster.local in-addr.arpa {
    kubeconfig ${N}/coredns.kubeconfig
    pods insecure
  }
  ready 127.0.0.1:18181
  health 127.0.0.1:18080
}
.:53 {
  bind ${NODE_IP}
  errors
}
EOF
  start coredns "$(bin_path coredns)" -conf "${N}/Corefile"
}

# The API server listens on loopback; pods reach it at NODE_IP (the `kubernetes` Service's endpoint).
forward_up() {
  start apiserver-forward socat "TCP-LISTEN:${APISERVER_PORT},bind=${NODE_IP},fork,reuseaddr" \
    "TCP:127.0.0.1:${APISERVER_PORT}"
}

# local-path-provisioner with one shared directory: ReadWriteOnce and ReadWriteMany claims,
# as one machine's directory is shared by every pod on it. Default StorageClass `local-path`.
provisioner_up() {
  mkdir -p "$VOLUMES"
  cat > "${N}/local-path.json" <<EOF
{"sharedFileSystemPath": "${VOLUMES}"}
EOF
  kubectl_admin apply --server-side --field-manager=kubetrain-hack -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: local-path-storage}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: local-path-provisioner, namespace: local-path-storage}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local-path
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: rancher.io/local-path
volumeBindingMode: Immediate
reclaimPolicy: Delete
---
apiVersion: v1
kind: ConfigMap
metadata: {name: local-path-config, namespace: local-path-storage}
data:
  setup: |-
    #!/bin/sh
    set -eu
    mkdir -m 0777 -p "\$VOL_DIR"
  teardown: |-
    #!/bin/sh
    set -eu
    rm -rf "\$VOL_DIR"
  helperPod.yaml: |-
    apiVersion: v1
    kind: Pod
    metadata: {name: helper-pod}
    spec:
      nodeSelector: {kubetrain.io/node: real}
      containers:
      - name: helper-pod
        image: ${HELPER_IMAGE}
        imagePullPolicy: Never
EOF
  kubectl_admin -n local-path-storage get configmap local-path-config \
    -o jsonpath='{.data.helperPod\.yaml}' > "${N}/helper-pod.yaml"
  start local-path-provisioner "$(bin_path local-path-provisioner)" --debug start \
    --config "${N}/local-path.json" --kubeconfig "${N}/local-path.kubeconfig" \
    --namespace local-path-storage --service-account-name local-path-provisioner \
    --helper-image "$HELPER_IMAGE" --configmap-name local-path-config \
    --helper-pod-file "${N}/helper-pod.yaml"
}

# ---------------------------------------------------------------- up / down
wait_ready() {
  local deadline=$((SECONDS + 90))
  until [[ "$(kubectl_admin get node "$NODE_NAME" \
      -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]; do
    if ((SECONDS >= deadline)); then
      tail -n 30 "${D}/logs/kubelet.log" >&2
      die "node ${NODE_NAME} not Ready after 90 s (logs: ${D}/logs/kubelet.log)"
    fi
    sleep 0.2
  done
}

up() {
  local why
  why="$(check)" || die "cannot run the real node here: ${why}"
  mkdir -p "$N" "${D}/logs"
  net_up
  node_pki
  for c in kubelet kube-proxy coredns local-path; do kubeconfig "$c"; done
  cni_config
  "${HACK_DIR}/containerd.sh" start >/dev/null
  import_small_images
  forward_up
  kubelet_up
  kube_proxy_up
  coredns_up
  wait_ready
  provisioner_up
  log "real node ${NODE_NAME} Ready ($(kubectl_admin get node "$NODE_NAME" \
    -o jsonpath='{.status.nodeInfo.containerRuntimeVersion}'))"
}

# Every pod sandbox and container the kubelet left behind, and their mounts and network namespaces.
remove_pods() {
  local ids
  ids="$(ctr_node containers ls -q 2>/dev/null || true)"
  if [[ -n "$ids" ]]; then
    # shellcheck disable=SC2086
    for id in $ids; do ctr_node tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    sleep 0.5
    # shellcheck disable=SC2086
    for id in $ids; do
      ctr_node tasks delete -f "$id" >/dev/null 2>&1 || true
      ctr_node containers rm "$id" >/dev/null 2>&1 || true
    done
  fi
}

# Mounts and network namespaces of pods, whether or not containerd is still there to ask.
remove_pod_leftovers() {
  local m
  for m in $(findmnt -rn -o TARGET | grep -E "^(${KUBELET_ROOT}|${KUBETRAIN_NODE_RUN})(/|$)" | sort -r || true); do
    umount -l "$m" 2>/dev/null || true
  done
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '/^cni-/{print $1}'); do ip netns delete "$ns" 2>/dev/null || true; done
  rm -rf "${KUBETRAIN_NODE_RUN}/cni/ipam"
}

down() {
  stop_procs
  if [[ -S "$CONTAINERD_SOCK" ]]; then remove_pods; fi
  remove_pod_leftovers
  "${HACK_DIR}/containerd.sh" stop
  rm -rf --one-file-system "$KUBELET_ROOT" "$VOLUMES" || log "left behind: a mount under ${KUBELET_ROOT}"
  net_down
  # The kubelet also writes here whatever --root-dir says.
  rmdir /var/lib/kubelet/device-plugins /var/lib/kubelet 2>/dev/null || true
}

case "${1:-}" in
  prepare) mkdir -p "$N"; net_up; node_pki ;;
  up) up ;;
  down) down ;;
  check) check ;;
  *) die "usage: $0 prepare | up | down | check" ;;
esac
