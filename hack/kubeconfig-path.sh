#!/usr/bin/env bash
# Print the admin kubeconfig path of the local test cluster (the file exists while it runs):
#   export KUBECONFIG="$(hack/kubeconfig-path.sh)"
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
echo "${KUBETRAIN_CLUSTER_DIR}/kubeconfig"
