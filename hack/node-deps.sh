#!/usr/bin/env bash
# Debian packages the real node and `make images` need: the container runtime (containerd,
# runc), the CNI plugins, nftables/conntrack for kube-proxy, socat, and buildah, skopeo +
# debootstrap for the images; and Java for the object store (S3Proxy, hack/objectstore.sh).
# Installs only what is missing; needs root and apt-get.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

declare -A PKG=([containerd]=containerd [runc]=runc [nft]=nftables [conntrack]=conntrack [socat]=socat
                [iptables]=iptables [buildah]=buildah [skopeo]=skopeo [debootstrap]=debootstrap
                [java]=openjdk-17-jre-headless)
want=()
for cmd in "${!PKG[@]}"; do command -v "$cmd" >/dev/null || want+=("${PKG[$cmd]}"); done
[[ -x /usr/lib/cni/bridge ]] || want+=(containernetworking-plugins)
[[ ${#want[@]} -gt 0 ]] || exit 0
[[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null \
  || die "missing packages: ${want[*]} (install them as root: apt-get install ${want[*]})"
log "installing ${want[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
# A system containerd the package may start keeps its own socket and root; the node never uses it.
