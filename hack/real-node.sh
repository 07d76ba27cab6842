#!/usr/bin/env bash
# The test cluster's real nodes: each a kubelet, kube-proxy, containerd + runc and a CNI bridge
# on this machine; node 1 with CoreDNS and a dynamic volume provisioner (local-path-provisioner)
# beside it. Pods run for real here; kwok's nodes only pretend. KUBETRAIN_REAL_NODES (default 2)
# says how many: node 1 (`kubetrain-node`) in this machine's network namespace, node k >= 2
# (`kubetrain-node-k`) in a network namespace of its own, joined to the host by a veth pair, so a
# node's traffic can be cut as a real partition would (hack/chaos.sh). Nodes 2 and up carry the taint
# EXTRA_TAINT: a pod lands there only when it says so, as on a cloud's dedicated node pool.
#
#   hack/real-node.sh prepare    node 1's bridge, firewall, credentials (before kube-apiserver,
#                                which advertises NODE_IP)
#   hack/real-node.sh up         everything else, every node; waits until each is Ready
#   hack/real-node.sh down       stops it all, removes pods' sandboxes, bridges, namespaces and the
#                                firewall, and restores the host settings it changed
#   hack/real-node.sh node-up K | node-down K    one node (the others keep running)
#   hack/real-node.sh check      exits 0 when this machine can run the nodes, else says why
#
# Containment: pods live on their node's bridge (NODE_POD_CIDR) with no NAT and no route
# out of the nodes' ranges (CLUSTER_POD_RANGE); nftables rules drop anything a pod sends beyond
# them. DNS is CoreDNS without a forward plugin, so no name is resolved outside the cluster. The
# API server is reached from pods through the `kubernetes` Service (advertised at node 1's address,
# forwarded to its loopback listener). Needs root, Linux with cgroups, nftables and overlayfs.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

D="${KUBETRAIN_CLUSTER_DIR}"
SUFFIX="$(node_suffix "$NODE_INDEX")"
N="${D}/node${SUFFIX}"               # this node's config, certificates, pid files
PKI="${D}/pki"
NODE_PKI="${PKI}/node${SUFFIX}"
APISERVER_PORT="${KUBETRAIN_APISERVER_PORT:-16443}"
KUBELET_ROOT="${NODE_ROOT}/kubelet"
POD_LOGS_DIR="${NODE_ROOT}/pod-logs"  # node 1: the kubelet's default, /var/log/pods
VOLUMES="${KUBETRAIN_NODE_ROOT}/volumes"  # node 1's provisioner's, shared by every node as a network file system would be
# Node k's pods' cgroups live under a root of their own, so a fault can freeze, kill or throttle one node's pods.
if ((NODE_INDEX == 1)); then CGROUP_ROOT="/"; else CGROUP_ROOT="/${NODE_NAME}"; fi
EXTRA_TAINT="kubetrain.io/node-pool=extra:NoSchedule"
NFT_TABLE="kubetrain_node"
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables vm.overcommit_memory kernel.panic kernel.panic_on_oops)
HELPER_IMAGE="docker.io/kubetrain/volume-helper:1.0"
if ((NODE_INDEX == 1)); then PROCS=(kubelet kube-proxy coredns local-path-provisioner apiserver-forward)
else PROCS=(kubelet kube-proxy); fi

kubectl_admin() { "$(bin_path kubectl)" --kubeconfig "${D}/kubeconfig" "$@"; }

check() {
  local missing=() c
  [[ "$(id -u)" == 0 ]] || { echo "the real node needs root"; return 1; }
  for c in containerd runc nft ip socat conntrack nsenter; do command -v "$c" >/dev/null || missing+=("$c"); done
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  [[ ${#missing[@]} -eq 0 ]] || { echo "missing: ${missing[*]} (hack/node-deps.sh installs them)"; return 1; }
  grep -qw overlay /proc/filesystems || { echo "no overlayfs in this kernel"; return 1; }
  ((REAL_NODES >= 1 && REAL_NODES <= 8)) || { echo "KUBETRAIN_REAL_NODES=${REAL_NODES}: 1 to 8"; return 1; }
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
    ip saddr ${CLUSTER_POD_RANGE} ip daddr != ${CLUSTER_POD_RANGE} counter name escaped drop
    ip daddr ${CLUSTER_POD_RANGE} ip saddr != ${CLUSTER_POD_RANGE} drop
  }
}
EOF
}

# Node k >= 2: its network namespace, a veth pair to the host (NODE_LINK_HOST <-> NODE_LINK_NODE),
# its bridge inside, routes both ways, and inside the same containment as the host's.
netns_up() {
  mkdir -p "$N"
  [[ -e "/run/netns/${NODE_NETNS}" ]] || ip netns add "$NODE_NETNS"
  if ! ip link show "$NODE_LINK" >/dev/null 2>&1; then
    ip link add "$NODE_LINK" type veth peer name eth0 netns "$NODE_NETNS"
  fi
  ip addr replace "${NODE_LINK_HOST}/30" dev "$NODE_LINK"
  ip link set "$NODE_LINK" up
  in_node ip link set lo up
  in_node ip addr replace "${NODE_LINK_NODE}/30" dev eth0
  in_node ip link set eth0 up
  in_node ip link show "$NODE_BRIDGE" >/dev/null 2>&1 || in_node ip link add "$NODE_BRIDGE" type bridge
  in_node ip link set "$NODE_BRIDGE" address "$NODE_BRIDGE_MAC"
  in_node ip addr replace "${NODE_IP}/16" dev "$NODE_BRIDGE"
  in_node ip link set "$NODE_BRIDGE" up
  in_node ip route replace "$CLUSTER_POD_RANGE" via "$NODE_LINK_HOST"
  in_node ip route replace "$SERVICE_CIDR" via "$NODE_LINK_HOST"
  ip route replace "$NODE_POD_CIDR" via "$NODE_LINK_NODE" dev "$NODE_LINK"
  in_node sysctl -qw net.ipv4.ip_forward=1
  in_node sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  in_node nft -f - <<EOF
table ip ${NFT_TABLE}
delete table ip ${NFT_TABLE}
table ip ${NFT_TABLE} {
  chain forward {
    type filter hook forward priority -10; policy accept;
    ip saddr ${CLUSTER_POD_RANGE} ip daddr != ${CLUSTER_POD_RANGE} drop
    ip daddr ${CLUSTER_POD_RANGE} ip saddr != ${CLUSTER_POD_RANGE} drop
  }
}
EOF
}

netns_down() {
  ip link del "$NODE_LINK" 2>/dev/null || true
  ip netns delete "$NODE_NETNS" 2>/dev/null || true
}

# cgroup_dirs: node k's cgroup root in every hierarchy (cgroup v1) or in the unified one (v2)
cgroup_dirs() {
  local h
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo "/sys/fs/cgroup${CGROUP_ROOT}"; return; fi
  for h in /sys/fs/cgroup/*/; do [[ -L "${h%/}" ]] || echo "${h%/}${CGROUP_ROOT}"; done
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
  [[ -f "${NODE_PKI}/.complete" ]] && return 0
  mkdir -p "${NODE_PKI}"
  local name subj pairs=("kubelet:/O=system:nodes/CN=system:node:${NODE_NAME}" "kube-proxy:/CN=system:kube-proxy")
  ((NODE_INDEX > 1)) || pairs+=("coredns:/O=system:masters/CN=kubetrain-coredns"
                                "local-path:/O=system:masters/CN=kubetrain-local-path")
  for pair in "${pairs[@]}"; do
    name="${pair%%:*}" subj="${pair#*:}"
    openssl ecparam -name prime256v1 -genkey -noout -out "${NODE_PKI}/${name}.key" 2>/dev/null
    openssl req -new -key "${NODE_PKI}/${name}.key" -subj "$subj" 2>/dev/null \
      | openssl x509 -req -CA "${PKI}/ca.crt" -CAkey "${PKI}/ca.key" -CAcreateserial -days 3650 \
          -out "${NODE_PKI}/${name}.crt" \
          -extfile <(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n') 2>/dev/null
  done
  touch "${NODE_PKI}/.complete"
}

kubeconfig() {  # kubeconfig <name>: a kubeconfig for NODE_PKI/<name>.crt
  local b64="base64 -w0" server="https://127.0.0.1:${APISERVER_PORT}" sni=""
  # Node k >= 2 has a loopback of its own: it reaches the API server through node 1's forward
  # (apiserver-forward), whose serving certificate names 127.0.0.1 and localhost.
  if ((NODE_INDEX > 1)); then server="https://${HOST_NODE_IP}:${APISERVER_PORT}" sni=", tls-server-name: localhost"; fi
  cat > "${N}/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubetrain-test
  cluster: {server: "${server}", certificate-authority-data: $($b64 < "${PKI}/ca.crt")${sni}}
users:
- name: $1
  user: {client-certificate-data: $($b64 < "${NODE_PKI}/$1.crt"), client-key-data: $($b64 < "${NODE_PKI}/$1.key")}
contexts:
- name: kubetrain-test
  context: {cluster: kubetrain-test, user: $1}
current-context: kubetrain-test
EOF
  chmod 600 "${N}/$1.kubeconfig"
}

# ------------------------------------------------------------- processes
start() {  # start <name> <command...>: a setsid'd background process in the node's network, with a pid file
  local name="$1"; shift
  # Once per node: a second copy (node-up again, restore-node after a fault that spared it) would fail to
  # bind, and its pid file would orphan the first.
  running "$name" && return 0
  ${NODE_EXEC[@]+"${NODE_EXEC[@]}"} setsid "$@" >"${D}/logs/${name}${SUFFIX}.log" 2>&1 < /dev/null &
  echo $! > "${N}/${name}.pid"
}

running() {  # running <name>: its pid file names a live process of its program
  local pid
  [[ -f "${N}/$1.pid" ]] || return 1
  pid="$(cat "${N}/$1.pid")"
  # A pid file can outlive its process (a crash, a reboot): only the program we started counts.
  pid_alive "$pid" && [[ "$(basename "$(readlink "/proc/${pid}/exe" 2>/dev/null)")" == "$(proc_binary "$1")" ]]
}

stop_procs() {
  local p pid
  for p in "${PROCS[@]}"; do
    running "$p" || { rm -f "${N}/${p}.pid"; continue; }
    pid="$(cat "${N}/${p}.pid")"
    rm -f "${N}/${p}.pid"
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
clusterDNS: [${HOST_NODE_IP}]
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
  # Nodes 2+ share node 1's filesystem: their own cgroup root, and their own pod log directory, since each
  # kubelet deletes the directories under its podLogsDir of pods it does not run (node 1's, if shared).
  ((NODE_INDEX == 1)) || printf 'cgroupRoot: %s\npodLogsDir: %s\n' "$CGROUP_ROOT" "$POD_LOGS_DIR" >> "${N}/kubelet.yaml"
  mkdir -p "$KUBELET_ROOT" "$POD_LOGS_DIR"
  local d taints=()
  # cgroup v1 wants the root in every hierarchy before the kubelet starts; v2 in the unified one.
  if ((NODE_INDEX > 1)); then
    for d in $(cgroup_dirs); do mkdir -p "$d"; done
    taints=(--register-with-taints="$EXTRA_TAINT")
  fi
  start kubelet "$(bin_path kubelet)" --config="${N}/kubelet.yaml" --kubeconfig="${N}/kubelet.kubeconfig" \
    --root-dir="$KUBELET_ROOT" --cert-dir="${N}/kubelet-pki" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
    --node-labels="kubetrain.io/node=real" ${taints[@]+"${taints[@]}"} \
    --v=1
}

kube_proxy_up() {
  cat > "${N}/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: "${N}/kube-proxy.kubeconfig"}
hostnameOverride: ${NODE_NAME}
clusterCIDR: ${CLUSTER_POD_RANGE}
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0}
EOF
  start kube-proxy "$(bin_path kube-proxy)" --config="${N}/kube-proxy.yaml" --v=1
}

# --------------------------------------------------------------------- CNI
# Pods get their node's pod range on the bridge and two routes via the node: the Service range and
# the other nodes' pods. No default route, so any other address is unreachable from a pod (and
# dropped if tried).
cni_config() {
  mkdir -p "${NODE_RUN}/cni/net.d"
  cat > "${NODE_RUN}/cni/net.d/10-kubetrain.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "kubetrain", "plugins": [
  {"type": "bridge", "bridge": "${NODE_BRIDGE}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "${NODE_POD_CIDR}", "rangeStart": "${NODE_IP%.0.1}.1.1", "gateway": "${NODE_IP}"}]],
            "routes": [{"dst": "${SERVICE_CIDR}", "gw": "${NODE_IP}"}, {"dst": "${CLUSTER_POD_RANGE}", "gw": "${NODE_IP}"}],
            "dataDir": "${NODE_RUN}/cni/ipam"}},
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

# local-path-provisioner with two classes. `local-path` (the default) over one shared directory: ReadWriteOnce
# and ReadWriteMany claims, as one machine's directory is shared by every pod on it. `local-rwo` over a
# directory per node (nodePathMap): ReadWriteOnce only, bound to the node of its first consumer, as a cloud's
# block storage (EBS, Persistent Disk, Azure Disk) is; it refuses ReadWriteMany claims.
provisioner_up() {
  mkdir -p "$VOLUMES" "${VOLUMES}-rwo"
  cat > "${N}/local-path.json" <<EOF
{"storageClassConfigs": {"local-path": {"sharedFileSystemPath": "${VOLUMES}"},
 "local-rwo": {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["${VOLUMES}-rwo"]}]}}}
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
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local-rwo
  annotations: {kubetrain.io/access-modes: ReadWriteOnce}
provisioner: rancher.io/local-path
volumeBindingMode: WaitForFirstConsumer
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
      tail -n 30 "${D}/logs/kubelet${SUFFIX}.log" >&2
      die "node ${NODE_NAME} not Ready after 90 s (logs: ${D}/logs/kubelet${SUFFIX}.log)"
    fi
    sleep 0.2
  done
}

node_up() {  # the selected node: node 1 with the host-side services, node k >= 2 in its namespace
  local start_s=$SECONDS c
  mkdir -p "$N" "${D}/logs"
  if ((NODE_INDEX == 1)); then net_up; else netns_up; fi
  node_pki
  for c in kubelet kube-proxy; do kubeconfig "$c"; done
  cni_config
  "${HACK_DIR}/containerd.sh" start >/dev/null
  import_small_images
  if ((NODE_INDEX == 1)); then kubeconfig coredns; kubeconfig local-path; forward_up; fi
  kubelet_up
  kube_proxy_up
  ((NODE_INDEX > 1)) || coredns_up
  wait_ready
  ((NODE_INDEX > 1)) || provisioner_up
  log "real node ${NODE_NAME} Ready in $((SECONDS - start_s))s ($(kubectl_admin get node "$NODE_NAME" \
    -o jsonpath='{.status.nodeInfo.containerRuntimeVersion}'))"
}

# Every node at once: node 1 here, the others each in a child of this script.
up() {
  local why k pids=() failed=0
  why="$(check)" || die "cannot run the real nodes here: ${why}"
  for ((k = 2; k <= REAL_NODES; k++)); do KUBETRAIN_NODE_INDEX="$k" "$0" node-up & pids+=($!); done
  node_up || failed=1
  for k in ${pids[@]+"${pids[@]}"}; do wait "$k" || failed=1; done
  ((failed == 0)) || die "a real node did not come up (logs: ${D}/logs/kubelet*.log)"
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
  for m in $(findmnt -rn -o TARGET | grep -E "^(${KUBELET_ROOT}|${NODE_RUN})(/|$)" | sort -r || true); do
    umount -l "$m" 2>/dev/null || true
  done
  local ns
  # Only this node's pods' namespaces: those its sandboxes no longer hold (the others' are in use).
  for ns in $(ip netns list 2>/dev/null | awk '/^cni-/{print $1}'); do
    ip netns pids "$ns" 2>/dev/null | grep -q . || ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "${NODE_RUN}/cni/ipam"
}

node_down() {
  local d
  stop_procs
  if [[ -S "$CONTAINERD_SOCK" ]]; then remove_pods; fi
  remove_pod_leftovers
  "${HACK_DIR}/containerd.sh" stop
  rm -rf --one-file-system "$KUBELET_ROOT" || log "left behind: a mount under ${KUBELET_ROOT}"
  if ((NODE_INDEX == 1)); then
    rm -rf --one-file-system "$VOLUMES" "${VOLUMES}-rwo" || true
    net_down
    # The kubelet also writes here whatever --root-dir says.
    rmdir /var/lib/kubelet/device-plugins /var/lib/kubelet 2>/dev/null || true
  else
    netns_down
    for d in $(cgroup_dirs); do find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true; done
  fi
}

# Every node that has a state directory, the extra ones first (node 1 holds the shared services).
down() {
  local dir k
  for dir in "${D}"/node-*; do
    k="${dir##*-}"
    [[ -d "$dir" && "$k" =~ ^[0-9]+$ ]] || continue
    KUBETRAIN_NODE_INDEX="$k" "$0" node-down || log "node ${k}: teardown incomplete"
    rm -rf "$dir"
  done
  node_down
}

one_node() {  # one_node <k> <node-up|node-down>: the named node alone
  [[ "${1:-}" =~ ^[1-8]$ ]] || die "usage: $0 $2 K (1 to 8)"
  KUBETRAIN_NODE_INDEX="$1" "$0" "$2"
}

case "${1:-}" in
  prepare) mkdir -p "$N"; net_up; node_pki ;;
  up) up ;;
  down) down ;;
  node-up) if [[ -n "${2:-}" ]]; then one_node "$2" node-up; else node_up; fi ;;
  node-down) if [[ -n "${2:-}" ]]; then one_node "$2" node-down; else node_down; fi ;;
  check) check ;;
  *) die "usage: $0 prepare | up | down | node-up [K] | node-down [K] | check" ;;
esac
