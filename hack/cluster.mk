# Test-cluster targets; the root Makefile includes this file
# (standalone: make -f hack/cluster.mk cluster-up).
#   make cluster-up           build missing binaries, start the control plane + kwok GPU nodes
#   make cluster-down         stop it (etcd data dropped; certificates and binaries kept)
#   make cluster-build        only build the binaries into $KUBETRAIN_CACHE/bin
#   make cluster-kubeconfig   print the admin kubeconfig path
#   make images               build the operator and trainer images, load them into the real node
#   make install              helm install the chart into the test cluster (the images `make images` loaded)
#   make uninstall            helm uninstall it
# Parameters are environment variables (KUBETRAIN_NODES, KUBETRAIN_NODE_GPUS, ...),
# see docs/testing.md.
CLUSTER_HACK := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

.PHONY: cluster-up cluster-down cluster-build cluster-kubeconfig install uninstall images
cluster-up:
	@bash $(CLUSTER_HACK)/cluster-up.sh
cluster-down:
	@bash $(CLUSTER_HACK)/cluster-down.sh
cluster-build:
	@bash $(CLUSTER_HACK)/build.sh
cluster-kubeconfig:
	@bash $(CLUSTER_HACK)/kubeconfig-path.sh
images:
	@bash $(CLUSTER_HACK)/images.sh
install:
	@bash $(CLUSTER_HACK)/install.sh install
uninstall:
	@bash $(CLUSTER_HACK)/install.sh uninstall
