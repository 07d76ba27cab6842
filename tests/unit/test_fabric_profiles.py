"""Fabric profiles: each rendered worker pod against what its cloud publishes (the source above each test)."""

import json

import pytest
from pydantic import ValidationError

from kubetrain.core.api import TrainingJob, TrainingJobSpec
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import fabrics


def pod(fabric: str, **spec) -> dict:
    job = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "llm", "namespace": "team-a"},
                                      "spec": {"workers": 2, "fabric": fabric, **spec}})
    return b.worker_pod(job, 0, 0, b.WorkerSettings())


def trainer(p: dict) -> dict:
    return p["spec"]["containers"][0]


def env(p: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in trainer(p)["env"] if "value" in e}


def mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def host_paths(p: dict) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in p["spec"]["volumes"] if "hostPath" in v}


# https://docs.nvidia.com/networking/display/cokan10/network+operator (RDMA shared device plugin: rdma/<resourceName>)
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html (NCCL_IB_HCA, NCCL_SOCKET_IFNAME)
def test_infiniband_requests_the_rdma_resource_with_ipc_lock_hca_and_shm():
    p = pod("infiniband", resources={"gpusPerWorker": 8})
    limits = trainer(p)["resources"]["limits"]
    assert limits["rdma/ib"] == "1" and limits["nvidia.com/gpu"] == "8"
    assert trainer(p)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    e = env(p)
    assert (e["NCCL_IB_DISABLE"], e["NCCL_IB_HCA"], e["NCCL_SOCKET_IFNAME"]) == ("0", "mlx5", "eth0")
    assert mounts(trainer(p))["dshm"] == "/dev/shm"
    # The resource name is the node's device plugin's, so it is a setting.
    other = pod("infiniband", fabricOptions={"rdmaResource": "rdma/hca_shared_devices_a", "rdmaDevices": 2,
                                             "ibHca": "=mlx5_0,mlx5_1"})
    assert trainer(other)["resources"]["requests"] == {"rdma/hca_shared_devices_a": "2"}
    assert env(other)["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"


# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-gid-index and #nccl-ib-tc
def test_roce_adds_the_gid_index_and_traffic_class():
    p = pod("roce")
    assert trainer(p)["resources"]["limits"] == {"rdma/roce": "1"}
    assert env(p)["NCCL_IB_GID_INDEX"] == "3" and "NCCL_IB_TC" not in env(p)
    assert "IPC_LOCK" in trainer(p)["securityContext"]["capabilities"]["add"]
    tuned = env(pod("roce", fabricOptions={"gidIndex": 5, "trafficClass": 106}))
    assert (tuned["NCCL_IB_GID_INDEX"], tuned["NCCL_IB_TC"], tuned["NCCL_IB_HCA"]) == ("5", "106", "mlx5")


# https://docs.aws.amazon.com/eks/latest/userguide/node-efa.html (awsdocs/amazon-eks-user-guide latest/ug/ml/node-efa.adoc):
# p5.48xlarge workers request vpc.amazonaws.com/efa: 32, hugepages-2Mi: 5120Mi, memory 32000Mi.
def test_efa_requests_every_efa_device_hugepages_and_memory_with_the_efa_provider():
    p = pod("efa", resources={"gpusPerWorker": 8})
    res = trainer(p)["resources"]
    assert res["limits"] == res["requests"] == {"vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi",
                                                "nvidia.com/gpu": "8", "memory": "32000Mi"}
    e = env(p)
    assert (e["FI_PROVIDER"], e["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1")
    assert (e["NCCL_BUFFSIZE"], e["NCCL_P2P_NET_CHUNKSIZE"]) == ("8388608", "524288")
    assert "IPC_LOCK" in trainer(p)["securityContext"]["capabilities"]["add"]
    # Per instance type: its EFA count, and only nodes of that type.
    p4d = pod("efa", fabricOptions={"instanceType": "p4d.24xlarge"}, resources={"memory": "64Gi"})
    assert trainer(p4d)["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"
    assert trainer(p4d)["resources"]["limits"]["memory"] == "64Gi"  # the user's memory, not the default
    assert p4d["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    mine = pod("efa", fabricOptions={"instanceType": "p5.48xlarge"},
               scheduling={"nodeSelector": {"node.kubernetes.io/instance-type": "p5e.48xlarge", "pool": "a"}})
    assert mine["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5e.48xlarge", "pool": "a"}


# https://github.com/GoogleCloudPlatform/container-engine-accelerators/blob/master/gpudirect-tcpx/nccl-test-latest.yaml
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/blob/master/gpudirect-tcpx/nccl-config.yaml
# https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx
def test_tcpx_adds_the_daemon_sidecar_multi_nic_annotations_plugin_volumes_and_env():
    p = pod("tcpx", resources={"gpusPerWorker": 8})
    ann = p["metadata"]["annotations"]
    assert ann["networking.gke.io/default-interface"] == "eth0"
    assert json.loads(ann["networking.gke.io/interfaces"]) == [
        {"interfaceName": "eth0", "network": "default"}, *[
            {"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 5)]]
    devices = ann["devices.gke.io/container.tcpx-daemon"].splitlines()
    assert devices[:8] == [f"- path: /dev/nvidia{i}" for i in range(8)]
    assert devices[8:] == ["- path: /dev/nvidiactl", "- path: /dev/nvidia-uvm"]
    (daemon,) = p["spec"]["initContainers"]
    assert daemon["name"] == "tcpx-daemon" and daemon["restartPolicy"] == "Always"  # a native sidecar
    assert daemon["image"] == fabrics.TCPX_DAEMON_IMAGE and daemon["command"][0].endswith("tcpgpudmarxd")
    assert daemon["command"][daemon["command"].index("--gpu_nic_preset") + 1] == "a3vm"
    assert daemon["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"]
    assert mounts(daemon) == {"nvidia-lib": "/usr/local/nvidia/lib64", "sys": "/hostsysfs",
                              "proc-sys": "/hostprocsysfs", "tcpx-socket": "/run/tcpx"}
    assert host_paths(p) == {"nvidia-lib": "/home/kubernetes/bin/nvidia/lib64", "sys": "/sys", "proc-sys": "/proc/sys"}
    assert mounts(trainer(p))["nvidia-lib"] == "/usr/local/nvidia/lib64"  # the TCPX NCCL plugin
    assert mounts(trainer(p))["tcpx-socket"] == "/run/tcpx"  # the daemon's unix socket
    e = env(p)
    assert e["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert e["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
    assert (e["NCCL_GPUDIRECTTCPX_CTRL_DEV"], e["NCCL_SOCKET_IFNAME"]) == ("eth0", "eth0")
    assert e["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"
    assert (e["NCCL_CROSS_NIC"], e["NCCL_NET_GDR_LEVEL"], e["NCCL_P2P_PXN_LEVEL"]) == ("0", "PIX", "0")
    assert trainer(p)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    named = pod("tcpx", fabricOptions={"gpuNetworks": ["gpu-a", "gpu-b", "gpu-c", "gpu-d"],
                                       "daemonImage": "registry.example/rxdm:v9"})
    nets = json.loads(named["metadata"]["annotations"]["networking.gke.io/interfaces"])
    assert [n["network"] for n in nets] == ["default", "gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    assert named["spec"]["initContainers"][0]["image"] == "registry.example/rxdm:v9"


# https://github.com/GoogleCloudPlatform/container-engine-accelerators/blob/master/gpudirect-tcpxo/nccl-test-latest.yaml
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/blob/master/gpudirect-tcpxo/best-practice.md
# (tcpxo-daemon as a native sidecar); nccl-env-profile.sh shipped by the nccl-tcpxo-installer.
def test_tcpxo_adds_the_fastrak_daemon_eight_nics_aperture_devices_and_env():
    p = pod("tcpxo", resources={"gpusPerWorker": 8})
    ann = p["metadata"]["annotations"]
    nets = json.loads(ann["networking.gke.io/interfaces"])
    assert [n["interfaceName"] for n in nets] == [f"eth{i}" for i in range(9)]
    assert ann["devices.gke.io/container.tcpxo-daemon"].splitlines()[-1] == "- path: /dev/dmabuf_import_helper"
    (daemon,) = p["spec"]["initContainers"]
    assert (daemon["name"], daemon["restartPolicy"], daemon["image"]) == (
        "tcpxo-daemon", "Always", fabrics.TCPXO_DAEMON_IMAGE)
    assert "--num_nics=8" in daemon["command"][-1] and "entrypoint_rxdm_container.sh" in daemon["command"][-1]
    assert daemon["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_BIND_SERVICE"]
    assert host_paths(p)["aperture-devices"] == "/dev/aperture_devices"
    assert mounts(trainer(p))["aperture-devices"] == "/dev/aperture_devices"
    e = env(p)
    assert e["NCCL_FASTRAK_IFNAME"] == ",".join(f"eth{i}" for i in range(1, 9))
    assert (e["NCCL_FASTRAK_CTRL_DEV"], e["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"]) == ("eth0", "/dev/aperture_devices")
    assert (e["NCCL_FASTRAK_USE_SNAP"], e["NCCL_FASTRAK_USE_LLCM"], e["NCCL_TUNER_PLUGIN"]) == (
        "1", "1", "libnccl-tuner.so")
    assert e["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"


# https://github.com/Azure/aks-rdma-infiniband configs/nicclusterpolicy/rdma-shared-device-plugin/rdma.yaml
# (resourceName shared_ib -> rdma/shared_ib) and https://github.com/Azure/azhpc-images customizations/ndv5.sh
# (NCCL_IB_PCI_RELAXED_ORDERING=1, NCCL_TOPO_FILE=/opt/microsoft/ndv5/topo.xml, NCCL_IGNORE_CPU_AFFINITY=1).
def test_aks_infiniband_uses_azures_resource_and_nd_h100_v5_nccl_settings():
    p = pod("aks-infiniband", resources={"gpusPerWorker": 8})
    assert trainer(p)["resources"]["limits"]["rdma/shared_ib"] == "1"
    assert "IPC_LOCK" in trainer(p)["securityContext"]["capabilities"]["add"]
    e = env(p)
    assert (e["NCCL_IB_PCI_RELAXED_ORDERING"], e["NCCL_TOPO_FILE"], e["NCCL_IGNORE_CPU_AFFINITY"]) == (
        "1", "/opt/microsoft/ndv5/topo.xml", "1")
    assert e["NCCL_IB_DISABLE"] == "0"
    sriov = pod("aks-infiniband", fabricOptions={"rdmaResource": "rdma/ib", "rdmaDevices": 8, "topoFile": ""})
    assert trainer(sriov)["resources"]["limits"] == {"rdma/ib": "8"}
    assert "NCCL_TOPO_FILE" not in env(sriov)


def test_none_adds_nothing_and_the_users_env_and_resources_win_over_any_profile():
    plain = pod("none")
    assert "initContainers" not in plain["spec"] and trainer(plain)["resources"] == {}
    for fabric in fabrics.RENDERERS:
        p = pod(fabric, env=[{"name": "NCCL_SOCKET_IFNAME", "value": "ib0"}],
                resources={"extra": {"vpc.amazonaws.com/efa": "1", "rdma/ib": "2"}})
        assert env(p).get("NCCL_SOCKET_IFNAME") == "ib0", fabric
        assert trainer(p)["resources"]["limits"]["rdma/ib"] == "2", fabric


@pytest.mark.parametrize("fabric", ["tcpx", "tcpxo"])
def test_a_users_pod_template_merges_into_the_sidecar_by_name(fabric):
    daemon = f"{fabric}-daemon"
    p = pod(fabric, podTemplate={"spec": {"initContainers": [{"name": daemon, "imagePullPolicy": "Always"}]}})
    (sidecar,) = p["spec"]["initContainers"]
    assert sidecar["imagePullPolicy"] == "Always" and sidecar["restartPolicy"] == "Always"


def test_host_paths_and_a_sidecars_capabilities_need_privileged():
    assert {n: p.pod_security for n, p in fabrics.FABRICS.items()} == {
        "none": "restricted", "infiniband": "privileged", "roce": "privileged", "efa": "privileged",
        "tcpx": "privileged", "tcpxo": "privileged", "aks-infiniband": "privileged"}
    assert fabrics.FabricProfile({}, {}, sidecars=({"securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}},)
                                 ).pod_security == "privileged"
    assert fabrics.FabricProfile({}, {}, volumes=({"name": "x", "hostPath": {"path": "/x"}},)).pod_security == \
        "privileged"


@pytest.mark.parametrize(("spec", "path", "words"), [
    ({"fabricOptions": {"gidIndex": 1}}, "fabricOptions", "fabricOptions needs a fabric"),
    ({"fabric": "tcpxo", "fabricOptions": {"gpuNetworks": ["a", "b", "c", "d"]}}, "fabricOptions.gpuNetworks",
     "8 for tcpxo"),
    ({"fabric": "efa", "fabricOptions": {"gpuNetworks": ["a", "b", "c", "d"]}}, "fabricOptions.gpuNetworks",
     "4 for fabric tcpx"),
])
def test_fabric_options_that_cannot_apply_are_refused_naming_the_field(spec, path, words):
    ((where, message),) = TrainingJobSpec.model_validate(spec).rule_violations()
    assert where == path and words in message


@pytest.mark.parametrize("options", [
    {"rdmaResource": "ib"}, {"rdmaResource": "rdma/ib dev"}, {"instanceType": "p3.2xlarge"},
    {"gpuNetworks": ["a", "b"]}, {"daemonImage": ""}, {"topoFile": "relative.xml"}, {"unknown": 1},
])
def test_malformed_fabric_options_are_refused(options):
    with pytest.raises(ValidationError, match="fabric"):
        TrainingJobSpec.model_validate({"fabric": "infiniband", "fabricOptions": options})
